"""Expert parallelism: a mixture-of-experts layer with its experts spread over the ranks.

    torchrun --standalone --nproc_per_node=2 scripts/ch8_experts.py
    torchrun --standalone --nproc_per_node=4 scripts/ch8_experts.py --experts 8
    python scripts/ch8_experts.py            # a world of one: every expert local

A mixture-of-experts (MoE) layer replaces one MLP by E of them, the experts, and a router that
sends each token to one expert (top-1, as in the Switch Transformer), scaling the expert's output
by the router's probability for it. With expert parallelism each rank holds E/N experts and its
own share of the tokens. A step routes the local tokens, sorts them by the rank that holds their
expert, and exchanges them with one all_to_all (each rank sends every other rank the tokens for
its experts), runs its experts, and sends the results back with a second all_to_all. Backward
runs the same two exchanges in reverse. The router is replicated; its gradient is summed over
the ranks, as data parallelism would.

The script builds the layer from one seed on every rank and compares, on the same tokens, the
expert-parallel layer's outputs and gradients with the same layer run on one process (every
rank computes it). The control leaves the router's gradient unsummed. It then times a step with
the router's choices balanced and with --skew of the tokens forced to the experts of rank 0.
"""

import argparse
import copy
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.collectives import CollectiveLog
from dtbook.compare import training_gap
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group
from dtbook.timing import time_in_turns


class MoE(nn.Module):
    """Top-1 mixture of experts: a router and E two-layer MLPs (the reference)."""

    def __init__(self, width: int, experts: int):
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                          nn.Linear(4 * width, width))
            for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (tokens, width)
        probs = self.router(x).softmax(dim=-1)
        gate, choice = probs.max(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mine = choice == e
            out[mine] = expert(x[mine])
        return out * gate[:, None]


class AllToAll(torch.autograd.Function):
    """Forward: send ``send[q]`` rows to rank q, get ``recv[q]`` from it.
    Backward: the same exchange in reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int]):
        ctx.counts = send, recv
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send, recv = ctx.counts
        back = grad.new_empty(sum(send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), send, recv)
        return back, None, None


class ExpertParallelMoE(nn.Module):
    """The same layer with experts ``r*E/N ... (r+1)*E/N - 1`` on rank r."""

    def __init__(self, moe: MoE):
        super().__init__()
        rank, self.world = dist.get_rank(), dist.get_world_size()
        self.per_rank = len(moe.experts) // self.world
        self.first = rank * self.per_rank
        self.router = moe.router  # replicated
        mine = range(self.first, self.first + self.per_rank)
        self.experts = nn.ModuleList(moe.experts[i] for i in mine)

    def forward(self, x: torch.Tensor, force: torch.Tensor | None = None):
        """x: this rank's tokens; ``force``, added to the router's logits,
        overrides its choices (the load-imbalance experiment)."""
        logits = self.router(x)
        probs = (logits if force is None else logits + force).softmax(dim=-1)
        gate, choice = probs.max(dim=-1)
        order = choice.argsort(stable=True)  # grouped by expert, so by rank
        per_expert = choice.bincount(minlength=self.per_rank * self.world)
        send = per_expert.view(self.world, self.per_rank).sum(1).tolist()
        # Everyone tells everyone how many tokens are coming, for which expert.
        recv_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(recv_per_expert, per_expert)
        recv = recv_per_expert.view(self.world, self.per_rank).sum(1).tolist()
        tokens = AllToAll.apply(x[order], send, recv)
        # Rank 0's tokens for my experts, in expert order, then rank 1's, ...
        chunks = tokens.split(recv_per_expert.tolist())
        done = [self.experts[i % self.per_rank](chunk)
                for i, chunk in enumerate(chunks)]
        back = AllToAll.apply(torch.cat(done), recv, send)
        out = torch.empty_like(back).index_copy(0, order, back)  # undo the sort
        return out * gate[:, None]


def routed_away(layer: ExpertParallelMoE, x: torch.Tensor) -> int:
    """How many of this rank's tokens the router sends to experts on other ranks."""
    with torch.no_grad():
        owner = layer.router(x).argmax(dim=-1) // layer.per_rank
    return int((owner != dist.get_rank()).sum())


def gathered(value) -> list:
    """``value`` from every rank, in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def unsplit_gradients(layer: ExpertParallelMoE) -> dict[str, torch.Tensor]:
    """Every gradient under its name in the unsplit MoE, on every rank.

    The router's is this rank's (sum it over the ranks first); each expert's comes from the
    rank that owns the expert.
    """
    grads = {f"router.{n}": p.grad for n, p in layer.router.named_parameters()}
    owned = {f"experts.{layer.first + i}.{n}": p.grad
             for i, e in enumerate(layer.experts) for n, p in e.named_parameters()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, owned)
    for part in everyone:
        grads.update(part)
    return grads


def parse_args(argv=None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--experts", type=positive_int, default=4,
                        help="experts in the layer (default: 4)")
    parser.add_argument("--width", type=positive_int, default=128,
                        help="token width (default: 128)")
    parser.add_argument("--tokens", type=positive_int, default=2048,
                        help="tokens per rank per step (default: 2048)")
    parser.add_argument("--skew", type=float, default=0.9,
                        help="share of tokens forced to rank 0's experts in the imbalanced "
                             "timing (default: 0.9)")
    parser.add_argument("--steps", type=positive_int, default=10,
                        help="timed steps per routing (default: 10)")
    parser.add_argument("--seed", type=int, default=0)
    add_backend_and_metrics(parser)
    return parser.parse_args(argv)


def check_inputs(args: argparse.Namespace, world: int) -> None:
    if args.experts % world:
        raise ScriptError(f"{args.experts} experts do not spread evenly over {world} "
                          f"processes: use a process count that divides {args.experts}")
    if not 0 <= args.skew <= 1:
        raise ScriptError(f"--skew is a share of the tokens, between 0 and 1, not {args.skew}")


def main() -> None:
    args = parse_args()
    check_inputs(args, int(os.environ.get("WORLD_SIZE", 1)))
    backend, device = start_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    torch.manual_seed(args.seed)
    reference = MoE(args.width, args.experts).to(device)
    everything = torch.randn(world * args.tokens, args.width, device=device)
    weights = torch.randn_like(everything)  # loss = <out, weights> / tokens: any fixed target

    def loss_of(out: torch.Tensor, rows: slice) -> torch.Tensor:
        return (out * weights[rows]).sum() / everything.shape[0]

    ref = copy.deepcopy(reference)
    ref_out = ref(everything)
    loss_of(ref_out, slice(None)).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)  # this rank's tokens

    for name, sum_router in [("expert parallel", True), ("control: router grad unsummed", False)]:
        layer = ExpertParallelMoE(copy.deepcopy(reference))
        # As inside a model, the layer's input needs its gradient: four exchanges.
        x = everything[mine].clone().requires_grad_()
        with CollectiveLog() as log:  # the tokens' bytes, both ways, forward and backward
            out = layer(x)
            loss_of(out, mine).backward()
        moved = [e for e in log.collectives() if e["op"] == "all_to_all"]
        if sum_router:  # every rank's tokens went through the same router
            for p in layer.router.parameters():
                dist.all_reduce(p.grad)
        outs = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out.detach())
        grads = unsplit_gradients(layer)
        record = {"version": name,
                  "output_gap": ((torch.cat(outs) - ref_out).norm() / ref_out.norm()).item(),
                  "grad_gap": training_gap(grads, ref_grads),
                  # per rank: the token rows only (the routing counts are int64)
                  "sent_bytes": gathered(sum(e["traffic_bytes"] for e in moved
                                             if e["dtype"] == "float32")),
                  "routed_away": gathered(routed_away(layer, everything[mine])),
                  "params_per_rank": sum(p.numel() for p in layer.parameters()),
                  "params": sum(p.numel() for p in reference.parameters())}
        metrics.write(event="compare", **record)
        if rank == 0:
            print(f"{name:<30} relative gap: outputs {record['output_gap']:.1e}, "
                  f"gradients {record['grad_gap']:.1e}")

    # What load imbalance does: the same layer, the router's choices forced.
    timed, received = {}, {}
    for label, share in [("balanced", None), ("skewed", args.skew)]:
        layer = ExpertParallelMoE(copy.deepcopy(reference))
        x = everything[mine].clone().requires_grad_()
        if share is None:  # every expert gets the same number of tokens
            choice = torch.arange(args.tokens) % args.experts
        else:  # ``share`` of the tokens to expert 0 (on rank 0), the rest spread evenly
            generator = torch.Generator().manual_seed(args.seed + rank)
            spread = torch.randint(0, args.experts, (args.tokens,), generator=generator)
            hot = torch.rand(args.tokens, generator=generator) < share
            choice = torch.where(hot, 0, spread)
        force = F.one_hot(choice, args.experts).float().to(device) * 100
        counts = torch.bincount(choice, minlength=args.experts).to(device)
        dist.all_reduce(counts)
        received[label] = counts.view(world, -1).sum(1).tolist()  # tokens each rank computes
        timed[label] = lambda layer=layer, x=x, force=force: layer(x, force).sum().backward()
    times = time_in_turns(timed, args.steps, 2, device)
    for label, ms in times.items():
        metrics.write(event="timing", routing=label, median_ms=statistics.median(ms),
                      tokens_per_rank=received[label])
        if rank == 0:
            print(f"{label:<9} routing: tokens computed per rank {received[label]}, "
                  f"median step {statistics.median(ms):.1f} ms (slowest rank)")
    metrics.write(event="shape", world=world, experts=args.experts, tokens=args.tokens,
                  width=args.width)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
