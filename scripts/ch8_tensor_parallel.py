"""Tensor parallelism (Megatron) by hand and with DTensor, each equal to one process.

    torchrun --standalone --nproc_per_node=2 scripts/ch8_tensor_parallel.py
    torchrun --standalone --nproc_per_node=4 scripts/ch8_tensor_parallel.py --api hand
    torchrun --standalone --nproc_per_node=2 scripts/ch8_tensor_parallel.py --sequence-parallel
    torchrun --standalone --nproc_per_node=2 scripts/ch8_tensor_parallel.py --time-steps 20
    python scripts/ch8_tensor_parallel.py            # a world of one: nothing is split

Every rank holds 1/N of each transformer block. The attention's fused qkv layer and the MLP's
first layer are split by output rows (column-parallel): each rank computes N-th of the heads and
of the hidden units, with no communication. The attention's output projection and the MLP's
second layer are split by input columns (row-parallel): each rank's product is a partial sum of
the full output, and one all-reduce adds them. Two collectives per sub-layer, as autograd
functions: f is the identity forward and an all-reduce backward (each rank's input gradient is
a partial sum too); g is the all-reduce forward and the identity backward. LayerNorms,
embeddings and the head are replicated.

The script builds the book's GPT on every rank from the same seed, runs one forward and backward
on the same batch through the unsplit model (the reference: what one process computes) and through
the hand-written TensorParallelBlock (--api hand), DTensor's parallelize_module with
ColwiseParallel and RowwiseParallel (--api dtensor), or both (the default). It records the gap of
the logits and of every weight gradient (gathered back to full size) to the reference, the
collectives one step issued and their bytes, and the placements DTensor gave the weights. The
control drops f's all-reduce in backward: its logits are right, its gradients are not.

--sequence-parallel (section 8.6) compares tensor parallelism alone with sequence parallelism:
the LayerNorms and residual adds between the split layers run on t/N tokens per rank, f becomes
an all-gather of the tokens and g a reduce-scatter (by hand: SequenceParallelBlock; with
DTensor: SequenceParallel in the plan). It records, besides the gaps and the collectives, the
bytes saved for backward inside the LayerNorms and elsewhere. Its control forgets to all-reduce
the gradients of the LayerNorm weights and biases, which each rank computed on its own tokens.

--time-steps N (section 8.8) then times N steps of the hand-written tensor parallelism against
the unsplit model's step (every rank computes it, as one process would), taking turns, the
slowest rank's time each; and it measures this placement's alpha and beta: all-reduces of a few
bytes and of the step's own sizes, timed alone. Where the processes run (one host, or one per
host across a link) is the launcher's choice; the times say what it cost.
"""

import argparse
import copy
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.collectives import CollectiveLog
from dtbook.comm_timing import seconds_per_call
from dtbook.compare import training_gap
from dtbook.cost_model import AlphaBeta, Measurement
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group
from dtbook.measure import SavedTensorsByRegion
from dtbook.model import GPT, MODEL_SIZES, Block
from dtbook.tensor_parallel import dtensor_parallel, heads_grouped_by_rank, shard, unshard
from dtbook.timing import spread, time_in_turns


class CopyToParallel(torch.autograd.Function):
    """f: forward the identity, backward the all-reduce of the input's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, reduce_backward: bool) -> torch.Tensor:
        ctx.reduce_backward = reduce_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce_backward:  # False only in the control run
            grad = grad.contiguous()
            # Each rank's gradient covers only its own heads or hidden units.
            dist.all_reduce(grad)
        return grad, None


class ReduceFromParallel(torch.autograd.Function):
    """g: forward the all-reduce of the partial outputs, backward the identity."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor) -> torch.Tensor:
        total = partial.contiguous()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad  # every rank already holds the full output's gradient


# How each split weight is cut: (dimension, parts). The fused qkv weight holds three parts
# (q, k, v); each is split by heads, so rank r keeps [q_r; k_r; v_r]. The rest is replicated.
SPLITS = {"qkv.weight": (0, 3), "qkv.bias": (0, 3), "mlp.0.weight": (0, 1),
          "mlp.0.bias": (0, 1), "proj.weight": (1, 1), "mlp.2.weight": (1, 1)}


class TensorParallelBlock(nn.Module):
    """One of the book's Blocks, its heads and hidden units split over the ranks."""

    def __init__(self, block: Block, reduce_backward: bool = True):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        self.head_dim, self.reduce_backward = block.head_dim, reduce_backward
        self.ln1, self.ln2 = block.ln1, block.ln2
        c = block.proj.in_features
        # The split layers live where the block's do, in its dtype (a GPU, float64).
        weight = block.proj.weight
        like = {"device": weight.device, "dtype": weight.dtype}
        self.qkv = nn.Linear(c, 3 * c // world, **like)
        # proj's bias is added once, after the sum
        self.proj = nn.Linear(c // world, c, **like)
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c // world, **like), nn.GELU(),
                                 nn.Linear(4 * c // world, c, **like))
        full = block.state_dict()
        with torch.no_grad():
            for name, tensor in self.state_dict().items():
                split = SPLITS.get(name)
                if split is not None:  # this rank's slice; the rest is replicated
                    tensor.copy_(shard(full[name], *split, rank, world))
                else:
                    tensor.copy_(full[name])

    def enter(self, h: torch.Tensor) -> torch.Tensor:
        """Into a column-parallel layer: f."""
        return CopyToParallel.apply(h, self.reduce_backward)

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        """Out of a row-parallel layer: g."""
        return ReduceFromParallel.apply(partial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enter(self.ln1(x))
        b, t, _ = h.shape
        q, k, v = self.qkv(h).chunk(3, dim=2)  # this rank's heads only
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        partial = F.linear(y.transpose(1, 2).reshape(b, t, -1), self.proj.weight)
        x = x + self.leave(partial) + self.proj.bias
        h = self.enter(self.ln2(x))
        partial = F.linear(self.mlp[1](self.mlp[0](h)), self.mlp[2].weight)
        return x + self.leave(partial) + self.mlp[2].bias


def hand_parallel(model: GPT, reduce_backward: bool = True) -> GPT:
    """The model with every block replaced by its tensor-parallel version."""
    model.blocks = nn.ModuleList(TensorParallelBlock(b, reduce_backward) for b in model.blocks)
    return model


# Sequence parallelism (--sequence-parallel). Outside the column/row-parallel pairs, every
# rank above computes the same LayerNorms and residual adds on all t tokens. Cut that work
# along the sequence instead: there each rank keeps t/N tokens. The collectives move: the
# one into a column-parallel layer all-gathers the tokens, the one out of a row-parallel
# layer reduce-scatters them (sums the partial outputs, keeps this rank's tokens).
# The collectives cut dimension 0, so the sequence (dimension 1) is moved there first.

def gather_sequence(x: torch.Tensor) -> torch.Tensor:
    """(b, t/N, C) on every rank -> (b, t, C), the ranks' tokens in rank order."""
    mine = x.transpose(0, 1).contiguous()
    full = mine.new_empty((dist.get_world_size() * mine.shape[0], *mine.shape[1:]))
    dist.all_gather_single(full, mine)
    return full.transpose(0, 1)


def reduce_scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    """(b, t, C) partial sums on every rank -> their sum, this rank's t/N tokens."""
    full = x.transpose(0, 1).contiguous()
    mine = full.new_empty((full.shape[0] // dist.get_world_size(), *full.shape[1:]))
    dist.reduce_scatter_single(mine, full)
    return mine.transpose(0, 1)


class GatherFromSequence(torch.autograd.Function):
    """Forward: all-gather the tokens. Backward: reduce-scatter, or keep mine."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, into_parallel: bool) -> torch.Tensor:
        ctx.into_parallel = into_parallel
        return gather_sequence(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.into_parallel:  # column-parallel: each rank's gradient is partial
            return reduce_scatter_sequence(grad), None
        rank, world = dist.get_rank(), dist.get_world_size()
        return grad.chunk(world, dim=1)[rank], None  # a replicated layer: all equal


class ReduceScatterToSequence(torch.autograd.Function):
    """Forward: reduce-scatter the partial outputs. Backward: all-gather."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_sequence(partial)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return gather_sequence(grad)


class ScatterToSequence(torch.autograd.Function):
    """Forward: keep this rank's tokens. Backward: all-gather their gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        return x.chunk(world, dim=1)[rank].clone()  # not a view: keep t/N tokens alive

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return gather_sequence(grad)


class SequenceParallelBlock(TensorParallelBlock):
    """TensorParallelBlock, its LayerNorms and residuals on t/N tokens per rank."""

    def enter(self, h: torch.Tensor) -> torch.Tensor:
        return GatherFromSequence.apply(h, True)

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        return ReduceScatterToSequence.apply(partial)


def hand_sequence_parallel(model: GPT) -> GPT:
    """Sequence-parallel blocks; the residual stream between them cut by tokens."""
    model.blocks = nn.ModuleList(SequenceParallelBlock(b) for b in model.blocks)
    model.blocks[0].register_forward_pre_hook(
        lambda _, args: ScatterToSequence.apply(args[0]))
    model.blocks[-1].register_forward_hook(  # ln_f and the head are replicated
        lambda _, args, out: GatherFromSequence.apply(out, False))
    return model


def sequence_weights(model: GPT) -> list[nn.Parameter]:
    """Replicated weights used on this rank's t/N tokens only."""
    return [p for b in model.blocks for p in (*b.ln1.parameters(),
            *b.ln2.parameters(), b.proj.bias, b.mlp[2].bias)]


def all_reduce_sequence_grads(model: GPT) -> None:
    """Each rank's gradient covers its own tokens: sum them, in one all-reduce."""
    grads = [p.grad for p in sequence_weights(model)]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    sizes = [g.numel() for g in grads]
    for grad, summed in zip(grads, flat.split(sizes), strict=True):
        grad.copy_(summed.view_as(grad))


def sgd_update(model: GPT) -> dict[str, torch.Tensor]:
    """What one SGD step (lr 1) changes in the weights used on t/N tokens.

    With DTensor their gradients are Partial: the update itself must sum them.
    """
    weights = sequence_weights(model)
    whole = [p.to_local() if isinstance(p, DTensor) else p for p in weights]  # Replicate
    before = [w.detach().clone() for w in whole]
    torch.optim.SGD(weights, lr=1.0).step()
    pairs = enumerate(zip(before, whole, strict=True))
    return {str(i): b - w.detach() for i, (b, w) in pairs}


def dtensor_sequence_parallel(model: GPT, mesh) -> GPT:
    """Sequence parallelism with PyTorch's API: SequenceParallel in between."""
    heads_grouped_by_rank(model, mesh.size())
    # Between the pairs the residual stream stays a DTensor cut by tokens, Shard(1):
    # its global shape is what the Block's forward reads (b, t, _ = x.shape).
    tokens = Shard(1)
    plan = {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
            "dropout": SequenceParallel(),
            "qkv": ColwiseParallel(input_layouts=tokens),
            "proj": RowwiseParallel(output_layouts=tokens, use_local_output=False),
            "mlp.0": ColwiseParallel(input_layouts=tokens),
            "mlp.2": RowwiseParallel(output_layouts=tokens, use_local_output=False)}
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
    # The embeddings' output enters cut by tokens; ln_f and the head get them all.
    parallelize_module(model, mesh, {
        "blocks.0": PrepareModuleInput(input_layouts=Replicate(),
                                       desired_input_layouts=Shard(1),
                                       use_local_output=False),
        "ln_f": PrepareModuleInput(input_layouts=Shard(1),
                                   desired_input_layouts=Replicate(),
                                   use_local_output=True)})
    return model


def full_gradients(model: GPT) -> dict[str, torch.Tensor]:
    """Every weight gradient at full size, in the unsplit model's layout, on every rank."""
    world = dist.get_world_size()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if isinstance(grad, DTensor):  # a Partial gradient is summed, a Shard kept local
            grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p
                                                 for p in grad.placements]).to_local()
        split = SPLITS.get(name.split(".", 2)[-1]) if name.startswith("blocks.") else None
        if split is not None:
            shards = [torch.empty_like(grad) for _ in range(world)]
            dist.all_gather(shards, grad.contiguous())
            grad = unshard(shards, *split)
        grads[name] = grad
    return grads


def placements(model: GPT) -> dict[str, str]:
    """What DTensor says about block 0's weights: how each is laid out over the mesh."""
    return {name: str(p.placements) for name, p in model.blocks[0].named_parameters()
            if isinstance(p, DTensor)}


def partial_sum_demo(model: GPT, mesh, x: torch.Tensor) -> dict[str, str]:
    """A row-parallel product on DTensors: its result is Partial until it is redistributed."""
    proj = model.blocks[0].proj
    local = x[..., : proj.weight.to_local().shape[1]]  # stands in for this rank's heads' output
    y = DTensor.from_local(local.contiguous(), mesh, [Shard(2)])
    partial = F.linear(y, proj.weight)
    summed = partial.redistribute(mesh, [Replicate()])  # the all-reduce
    return {"input": str(y.placements), "weight": str(proj.weight.placements),
            "product": str(partial.placements), "redistributed": str(summed.placements)}


def step(model: GPT, x: torch.Tensor, y: torch.Tensor, finish=None):
    """One forward and backward (then ``finish(model)``); the logits and the loss."""
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    if finish is not None:
        finish(model)
    return logits.detach(), loss.item()


def time_all_reduces(sizes: list[int], device: torch.device) -> list[Measurement]:
    """This placement's all-reduce times, measured now: a few bytes and the sizes
    a step sends, each timed alone, back to back (alpha and beta are fitted to
    them)."""
    world, measured = dist.get_world_size(), []
    for nbytes in sorted({256, *sizes, 2 * max(sizes)}):
        buffer = torch.zeros(nbytes // 4, device=device)
        rounds = seconds_per_call(lambda b=buffer: dist.all_reduce(b), calls=3,
                                  rounds=3, device=device)
        seconds = statistics.median(rounds)
        measured.append(Measurement("all_reduce", world, nbytes, seconds))
    return measured


def time_steps(reference: GPT, x: torch.Tensor, y: torch.Tensor, steps: int,
               device: torch.device) -> dict:
    """--time-steps: a tensor-parallel step against the unsplit model's, in turns."""
    split, whole = hand_parallel(copy.deepcopy(reference)), copy.deepcopy(reference)
    with CollectiveLog() as log:
        step(split, x, y)
    sizes = [e["bytes"] for e in log.collectives()]  # what one step all-reduces
    all_reduces = time_all_reduces(sizes, device)
    link = AlphaBeta.fit(all_reduces, world_size=dist.get_world_size())

    def clear(model: GPT) -> None:  # each timed step starts without gradients
        model.zero_grad(set_to_none=True)

    times = time_in_turns({"tensor_parallel": lambda: step(split, x, y, clear),
                           "one_process": lambda: step(whole, x, y, clear)},
                          steps, warmup=2, device=device)
    return {"message_bytes": sizes, "alpha_s": link.alpha_s,
            "beta_s_per_byte": link.beta_s_per_byte,
            "all_reduce_ms_by_size": {m.nbytes: 1000 * m.seconds
                                      for m in all_reduces},
            **{f"{name}_ms": spread(ms) for name, ms in times.items()}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small",
                        help="model size (default: small)")
    parser.add_argument("--api", choices=["hand", "dtensor", "both"], default="both",
                        help="which tensor-parallel versions to compare (default: both)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="compare sequence parallelism with tensor parallelism alone")
    parser.add_argument("--batch-size", type=positive_int, default=8,
                        help="windows in the batch every rank sees (default: 8)")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="tokens per window (default: the model's context)")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--time-steps", type=positive_int, metavar="N",
                        help="also time N tensor-parallel steps against one process's")
    add_backend_and_metrics(parser)
    return parser.parse_args(argv)


def check_inputs(args: argparse.Namespace, world: int) -> None:
    """Refuse a world size that does not split the heads (or the tokens) evenly."""
    cfg = MODEL_SIZES[args.model]
    if args.time_steps and world == 1:
        raise ScriptError("--time-steps compares tensor parallelism with one process: "
                          "launch 2 or more processes (torchrun --nproc_per_node=2)")
    if cfg.n_head % world:
        raise ScriptError(f"the {args.model} model's {cfg.n_head} attention heads do not split "
                          f"over {world} processes: use a process count that divides "
                          f"{cfg.n_head}, or another --model")
    seq_len = args.seq_len or cfg.context
    if seq_len > cfg.context:
        raise ScriptError(f"--seq-len {seq_len} is longer than the {args.model} model's "
                          f"context of {cfg.context} positions")
    if args.sequence_parallel and seq_len % world:
        raise ScriptError(f"windows of {seq_len} tokens do not cut into {world} equal parts "
                          f"for sequence parallelism: use a --seq-len divisible by {world}")


def versions_to_run(args: argparse.Namespace, mesh) -> dict:
    """Name -> (how to split a copy of the model, what to do after its backward)."""
    hand, api = args.api in ("hand", "both"), args.api in ("dtensor", "both")
    versions = {}
    if args.sequence_parallel:
        if hand:
            versions["tensor parallel"] = (hand_parallel, None)
            versions["sequence parallel"] = (hand_sequence_parallel,
                                             all_reduce_sequence_grads)
            versions["control: LayerNorm grads not summed"] = (hand_sequence_parallel, None)
        if api:
            versions["dtensor sequence parallel"] = (
                lambda m: dtensor_sequence_parallel(m, mesh), None)
        return versions
    if hand:
        versions["hand"] = (hand_parallel, None)
        versions["control: f without all-reduce"] = (lambda m: hand_parallel(m, False), None)
    if api:
        versions["dtensor"] = (lambda m: dtensor_parallel(m, mesh), None)
        versions["control: qkv cut in one piece"] = (
            lambda m: dtensor_parallel(m, mesh, False), None)
    return versions


def describe(summary: dict[str, dict]) -> str:
    """'4 all_reduce (40,960 B)' for each collective of a step."""
    return ", ".join(f"{row['count']} {op} ({row['bytes']:,} B)" for op, row in summary.items())


def main() -> None:
    args = parse_args()
    check_inputs(args, int(os.environ.get("WORLD_SIZE", 1)))  # before the group: every rank fails fast
    backend, device = start_process_group(args.backend)
    world = dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    seq_len = args.seq_len or cfg.context
    dataset = corpus_windows(args.batch_size * seq_len + 1, cfg.vocab_size, seq_len, args.seed)
    # Tensor parallelism is not data parallelism: every rank sees the same batch.
    [(x, y)] = first_batches(dataset, args.batch_size, 0, 1, args.seed, 1, device)
    torch.manual_seed(args.seed)
    reference = GPT(cfg).to(device)
    ref_model = copy.deepcopy(reference)
    ref_logits, ref_loss = step(ref_model, x, y)
    ref_grads = {name: p.grad for name, p in ref_model.named_parameters()}
    ref_update = sgd_update(ref_model) if args.sequence_parallel else None

    mesh = None
    if args.api in ("dtensor", "both"):
        mesh = dist.device_mesh.init_device_mesh(device.type, (world,))
    grads, outputs = {}, {}
    for name, (make, finish) in versions_to_run(args, mesh).items():
        model = make(copy.deepcopy(reference))
        norms = [m for b in model.blocks for m in (b.ln1, b.ln2)]
        with CollectiveLog() as log, SavedTensorsByRegion(
                {"norms": norms}, model.parameters()) as saved:
            logits, loss = step(model, x, y, finish)
        grads[name], outputs[name] = full_gradients(model), logits
        collectives = log.summary()
        summary = collectives.get("all_reduce", {"count": 0, "bytes": 0, "traffic_bytes": 0})
        record = {"version": name, "loss": loss, "reference_loss": ref_loss,
                  "logits_gap": ((logits - ref_logits).norm() / ref_logits.norm()).item(),
                  "grad_gap": training_gap(grads[name], ref_grads),
                  "all_reduces": summary["count"], "all_reduce_bytes": summary["bytes"],
                  "traffic_bytes": summary["traffic_bytes"], "collectives": collectives,
                  "ops": sorted({e["op"] for e in log.collectives()}),
                  "saved_bytes": saved.bytes_by_region(),
                  "params_per_rank": sum(p.to_local().numel() if isinstance(p, DTensor)
                                         else p.numel() for p in model.parameters())}
        if args.sequence_parallel:  # after the step: do the weights move as one process's?
            record["update_gap"] = training_gap(sgd_update(model), ref_update)
        if name == "dtensor":
            record["placements"] = placements(model)
            record["partial_sum"] = partial_sum_demo(model, mesh, ref_logits[..., :cfg.n_embd])
        if name == "dtensor sequence parallel":
            record["placements"] = placements(model)
            record["grad_placements"] = {n: str(p.grad.placements) for n, p
                                         in model.blocks[0].named_parameters()}
        metrics.write(event="compare", **record)
        if dist.get_rank() == 0:
            print(f"{name:<35} loss {loss:.6f} (one process {ref_loss:.6f}); relative gap: "
                  f"logits {record['logits_gap']:.1e}, gradients {record['grad_gap']:.1e}; "
                  f"{describe(collectives) or 'no collectives'}")
    if "hand" in grads and "dtensor" in grads:
        metrics.write(event="hand_vs_dtensor", grad_gap=training_gap(grads["dtensor"], grads["hand"]))
    for a, b in [("sequence parallel", "tensor parallel"),
                 ("dtensor sequence parallel", "sequence parallel")]:
        if a in grads and b in grads:
            metrics.write(event="pair", a=a, b=b, grad_gap=training_gap(grads[a], grads[b]),
                          logits_gap=((outputs[a] - outputs[b]).norm() / outputs[b].norm()).item())
    if args.time_steps:
        timing = time_steps(reference, x, y, args.time_steps, device)
        metrics.write(event="timing", **timing)
        if dist.get_rank() == 0:
            print("ms per step, median (p25-p75): " + ", ".join(
                f"{name.removesuffix('_ms')} {t['median']:.1f} ({t['p25']:.1f}-{t['p75']:.1f})"
                for name, t in timing.items() if name.endswith("_ms")))
    metrics.write(event="shape", world=world, batch=args.batch_size, context=seq_len,
                  n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
                  params=sum(p.numel() for p in reference.parameters()))
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
