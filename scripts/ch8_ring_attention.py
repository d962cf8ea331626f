"""Context parallelism: ring attention by hand, equal to causal attention on one process.

    torchrun --standalone --nproc_per_node=2 scripts/ch8_ring_attention.py
    torchrun --standalone --nproc_per_node=4 scripts/ch8_ring_attention.py --seq-len 4096
    python scripts/ch8_ring_attention.py            # a world of one: one block, no ring

A sequence too long for one device's attention is cut into N contiguous blocks, one per rank:
rank r keeps the queries, keys and values of positions r*T/N to (r+1)*T/N - 1. Each rank then
computes its queries' attention against every key block by passing the key/value blocks around
a ring: at step i rank r holds the block of rank r - i, attends to it, and hands it on to rank
r + 1 while receiving the next one from rank r - 1. The softmax over all keys is built up one
block at a time (online softmax): a running maximum, a running sum of exponentials and a running
output, the last two rescaled whenever the maximum grows. Causality means blocks from later
ranks are skipped and the rank's own block is masked; so rank 0 computes one block, the last
rank all N.

The pass around the ring is an autograd function (its backward passes the gradients the other
way), so autograd differentiates the whole computation. The script compares the output and the
gradients of q, k and v with causal attention over the whole sequence on one process (every
rank computes it), and measures the bytes each rank saves for backward against that process's.
The control forgets the rescaling.
"""

import argparse
import os

import torch
import torch.distributed as dist

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.collectives import CollectiveLog
from dtbook.compare import training_gap
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group
from dtbook.measure import SavedTensors


def exchange(x: torch.Tensor, to: int, source: int) -> torch.Tensor:
    """Send ``x`` to rank ``to`` while receiving a tensor like it from ``source``."""
    received = torch.empty_like(x)
    # Both posted before either is waited on: a blocking send on every rank would
    # leave every rank waiting for a receiver.
    requests = [dist.isend(x.contiguous(), to), dist.irecv(received, source)]
    for request in requests:
        request.wait()
    return received


class RingPass(torch.autograd.Function):
    """Forward: hand the block to the next rank, take the previous rank's.
    Backward: the gradients travel the other way round."""

    @staticmethod
    def forward(ctx, block: torch.Tensor) -> torch.Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        return exchange(block, (rank + 1) % world, (rank - 1) % world)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        return exchange(grad, (rank - 1) % world, (rank + 1) % world)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   rescale: bool = True) -> torch.Tensor:
    """Causal attention of this rank's queries over every rank's keys and values."""
    rank, world = dist.get_rank(), dist.get_world_size()
    scale = q.shape[-1] ** -0.5
    top = q.new_full(q.shape[:-1] + (1,), -torch.inf)  # running maximum per query
    total = torch.zeros_like(top)  # running sum of exp(score - top)
    out = torch.zeros_like(q)  # running sum of exp(score - top) * value
    kv = torch.stack([k, v])  # travels as one tensor
    for step in range(world):
        source = (rank - step) % world  # whose block this rank holds now
        if source <= rank:  # later positions are never attended to: skip
            scores = q @ kv[0].transpose(-2, -1) * scale
            if source == rank:  # the diagonal block: causal within it
                scores = scores.masked_fill(
                    torch.ones_like(scores, dtype=torch.bool).triu(1), -torch.inf)
            new_top = torch.maximum(top, scores.amax(-1, keepdim=True))
            weights = torch.exp(scores - new_top)
            # Everything summed so far was relative to the old maximum: rescale it
            # (rescale=False: the control).
            shrink = torch.exp(top - new_top) if rescale else 1.0
            total = total * shrink + weights.sum(-1, keepdim=True)
            out = out * shrink + weights @ kv[1]
            top = new_top
        else:  # keep the block in the graph, or this rank would skip its part of the
            out = out + 0 * kv.sum()  # backward ring, and its neighbours would wait
        if step < world - 1:
            kv = RingPass.apply(kv)
    return out / total


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The whole sequence on one process, written out as ring_attention's blocks are."""
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    mask = torch.ones_like(scores, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, -torch.inf).softmax(-1) @ v


def parse_args(argv=None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--seq-len", type=positive_int, default=1024,
                        help="tokens in the sequence (default: 1024)")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    parser.add_argument("--head-dim", type=positive_int, default=16, help="width per head")
    parser.add_argument("--seed", type=int, default=0)
    add_backend_and_metrics(parser)
    return parser.parse_args(argv)


def check_inputs(args: argparse.Namespace, world: int) -> None:
    if args.seq_len % world:
        raise ScriptError(f"a sequence of {args.seq_len} tokens does not cut into {world} "
                          f"equal blocks: use a --seq-len divisible by {world}")


def main() -> None:
    args = parse_args()
    check_inputs(args, int(os.environ.get("WORLD_SIZE", 1)))
    backend, device = start_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    generator = torch.Generator().manual_seed(args.seed)
    shape = (1, args.heads, args.seq_len, args.head_dim)
    # Drawn on the CPU, so every device gets the same numbers; NCCL needs them on the GPU.
    q, k, v, target = (torch.randn(shape, generator=generator).to(device) for _ in range(4))

    full = {name: t.clone().requires_grad_() for name, t in zip("qkv", (q, k, v), strict=True)}
    with SavedTensors(exclude=full.values()) as saved:
        ref = causal_attention(full["q"], full["k"], full["v"])
    (ref * target).sum().backward()
    ref_grads = {name: t.grad for name, t in full.items()}
    metrics.write(event="one_process", saved_bytes=saved.bytes)

    block = slice(rank * args.seq_len // world, (rank + 1) * args.seq_len // world)
    for name, rescale in [("ring attention", True), ("control: no rescaling", False)]:
        mine = {n: t[:, :, block].clone().requires_grad_()
                for n, t in zip("qkv", (q, k, v), strict=True)}
        with CollectiveLog() as log:  # the blocks' bytes, forward and backward
            with SavedTensors(exclude=mine.values()) as saved:
                out = ring_attention(mine["q"], mine["k"], mine["v"], rescale)
            (out * target[:, :, block]).sum().backward()
        pieces = {n: [torch.empty_like(t) for _ in range(world)]
                  for n, t in [("out", out), *mine.items()]}
        dist.all_gather(pieces["out"], out.detach())
        for n, t in mine.items():
            dist.all_gather(pieces[n], t.grad)
        whole = {n: torch.cat(p, dim=2) for n, p in pieces.items()}
        saved_bytes = [None] * world
        dist.all_gather_object(saved_bytes, saved.bytes)
        record = {"version": name,
                  "output_gap": ((whole["out"] - ref).norm() / ref.norm()).item(),
                  "grad_gap": training_gap({n: whole[n] for n in "qkv"}, ref_grads),
                  "saved_bytes": saved_bytes,
                  "sent_bytes": log.summary().get("send", {}).get("traffic_bytes", 0)}
        metrics.write(event="compare", **record)
        if rank == 0:
            print(f"{name:<22} relative gap: output {record['output_gap']:.1e}, "
                  f"gradients {record['grad_gap']:.1e}; saved for backward per rank "
                  f"{[f'{b / 2**20:.2f} MiB' for b in saved_bytes]}")
    metrics.write(event="shape", world=world, seq_len=args.seq_len, heads=args.heads,
                  head_dim=args.head_dim)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
