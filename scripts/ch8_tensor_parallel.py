"""Tensor parallelism (Megatron) by hand and with DTensor, each equal to one process.

    torchrun --standalone --nproc_per_node=2 scripts/ch8_tensor_parallel.py
    torchrun --standalone --nproc_per_node=4 scripts/ch8_tensor_parallel.py --api hand
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
"""

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.collectives import CollectiveLog
from dtbook.compare import training_gap
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES, Block
from dtbook.tensor_parallel import dtensor_parallel, shard, unshard


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
        self.qkv = nn.Linear(c, 3 * c // world)
        self.proj = nn.Linear(c // world, c)  # its bias is added once, after the sum
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c // world), nn.GELU(),
                                 nn.Linear(4 * c // world, c))
        full = block.state_dict()
        with torch.no_grad():
            for name, tensor in self.state_dict().items():
                split = SPLITS.get(name)
                if split is not None:  # this rank's slice; the rest is replicated
                    tensor.copy_(shard(full[name], *split, rank, world))
                else:
                    tensor.copy_(full[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = CopyToParallel.apply(self.ln1(x), self.reduce_backward)
        q, k, v = self.qkv(h).chunk(3, dim=2)  # this rank's heads only
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        partial = F.linear(y.transpose(1, 2).reshape(b, t, -1), self.proj.weight)
        x = x + ReduceFromParallel.apply(partial) + self.proj.bias
        h = CopyToParallel.apply(self.ln2(x), self.reduce_backward)
        partial = F.linear(self.mlp[1](self.mlp[0](h)), self.mlp[2].weight)
        return x + ReduceFromParallel.apply(partial) + self.mlp[2].bias


def hand_parallel(model: GPT, reduce_backward: bool = True) -> GPT:
    """The model with every block replaced by its tensor-parallel version."""
    model.blocks = nn.ModuleList(TensorParallelBlock(b, reduce_backward) for b in model.blocks)
    return model


def full_gradients(model: GPT) -> dict[str, torch.Tensor]:
    """Every weight gradient at full size, in the unsplit model's layout, on every rank."""
    world = dist.get_world_size()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
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


def step(model: GPT, x: torch.Tensor, y: torch.Tensor):
    """One forward and backward; the logits and the loss."""
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    return logits.detach(), loss.item()


def parse_args(argv=None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small",
                        help="model size (default: small)")
    parser.add_argument("--api", choices=["hand", "dtensor", "both"], default="both",
                        help="which tensor-parallel versions to compare (default: both)")
    parser.add_argument("--batch-size", type=positive_int, default=8,
                        help="windows in the batch every rank sees (default: 8)")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    add_backend_and_metrics(parser)
    return parser.parse_args(argv)


def check_inputs(args: argparse.Namespace, world: int) -> None:
    """Refuse a world size that does not split the heads and hidden units evenly."""
    cfg = MODEL_SIZES[args.model]
    if cfg.n_head % world:
        raise ScriptError(f"the {args.model} model's {cfg.n_head} attention heads do not split "
                          f"over {world} processes: use a process count that divides "
                          f"{cfg.n_head}, or another --model")


def main() -> None:
    args = parse_args()
    check_inputs(args, int(os.environ.get("WORLD_SIZE", 1)))  # before the group: every rank fails fast
    backend, device = start_process_group(args.backend)
    world = dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    dataset = corpus_windows(args.batch_size * cfg.context + 1, cfg.vocab_size, cfg.context,
                             args.seed)
    # Tensor parallelism is not data parallelism: every rank sees the same batch.
    [(x, y)] = first_batches(dataset, args.batch_size, 0, 1, args.seed, 1, device)
    torch.manual_seed(args.seed)
    reference = GPT(cfg).to(device)
    ref_model = copy.deepcopy(reference)
    ref_logits, ref_loss = step(ref_model, x, y)
    ref_grads = {name: p.grad for name, p in ref_model.named_parameters()}

    versions = {}
    if args.api in ("hand", "both"):
        versions["hand"] = hand_parallel
        versions["control: f without all-reduce"] = lambda m: hand_parallel(m, False)
    if args.api in ("dtensor", "both"):
        mesh = dist.device_mesh.init_device_mesh(device.type, (world,))
        versions["dtensor"] = lambda m: dtensor_parallel(m, mesh)
        versions["control: qkv cut in one piece"] = lambda m: dtensor_parallel(m, mesh, False)
    grads = {}
    for name, make in versions.items():
        model = make(copy.deepcopy(reference))
        with CollectiveLog() as log:
            logits, loss = step(model, x, y)
        grads[name] = full_gradients(model)
        summary = log.summary().get("all_reduce", {"count": 0, "bytes": 0, "traffic_bytes": 0})
        record = {"version": name, "loss": loss, "reference_loss": ref_loss,
                  "logits_gap": ((logits - ref_logits).norm() / ref_logits.norm()).item(),
                  "grad_gap": training_gap(grads[name], ref_grads),
                  "all_reduces": summary["count"], "all_reduce_bytes": summary["bytes"],
                  "traffic_bytes": summary["traffic_bytes"],
                  "ops": sorted({e["op"] for e in log.collectives()}),
                  "params_per_rank": sum(p.to_local().numel() if isinstance(p, DTensor)
                                         else p.numel() for p in model.parameters())}
        if name == "dtensor":
            record["placements"] = placements(model)
            record["partial_sum"] = partial_sum_demo(model, mesh, ref_logits[..., :cfg.n_embd])
        metrics.write(event="compare", **record)
        if dist.get_rank() == 0:
            print(f"{name:<30} loss {loss:.6f} (one process {ref_loss:.6f}); relative gap: "
                  f"logits {record['logits_gap']:.1e}, gradients {record['grad_gap']:.1e}; "
                  f"{summary['count']} all-reduces of {summary['bytes']:,} B in all")
    if "hand" in grads and "dtensor" in grads:
        metrics.write(event="hand_vs_dtensor", grad_gap=training_gap(grads["dtensor"], grads["hand"]))
    metrics.write(event="shape", world=world, batch=args.batch_size, context=cfg.context,
                  n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
                  params=sum(p.numel() for p in reference.parameters()))
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
