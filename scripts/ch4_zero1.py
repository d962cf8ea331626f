"""ZeRO stage 1 in a page: each rank keeps the optimizer state of its own share of
the parameters.

    torchrun --standalone --nproc_per_node=2 scripts/ch4_zero1.py
    python scripts/ch4_zero1.py                 # a world of one: one rank owns everything

DDP averages every gradient on every rank, so every rank could step every parameter,
and in plain data parallelism every rank does, keeping a full copy of the optimizer
state: for AdamW that is two numbers per parameter, twice the model. ShardedOptimizer
below splits the parameters between the ranks; each rank builds the wrapped optimizer
(any torch.optim class) over its share only, steps that share, and broadcasts the
updated values to the other ranks.

The script trains the same model from the same start on the same batches three ways,
with DDP averaging the gradients each time: the plain optimizer, ShardedOptimizer,
and PyTorch's own ZeroRedundancyOptimizer. It does so for AdamW and for SGD with
momentum, and records after every step how far apart the weights are, and how many
bytes of optimizer state each rank holds.
"""

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES

OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2}),
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


class ShardedOptimizer:
    """Any torch.optim optimizer, with the state of 1/N of the parameters on each
    rank."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer],
                 **defaults):
        self.params = [p for p in params if p.requires_grad]
        rank, world_size = dist.get_rank(), dist.get_world_size()
        # Largest parameter first, each to the rank that owns the fewest elements so
        # far. Every rank computes the same partition, so no rank has to be told who
        # owns what.
        self.owned: list[list[nn.Parameter]] = [[] for _ in range(world_size)]
        load = [0] * world_size
        for param in sorted(self.params, key=lambda p: p.numel(), reverse=True):
            owner = load.index(min(load))
            self.owned[owner].append(param)
            load[owner] += param.numel()
        self.optimizer = optimizer_class(self.owned[rank], **defaults)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()  # only this rank's share, with only this rank's state
        # One broadcast per owner: its parameters, flattened, to every other rank.
        for owner, params in enumerate(self.owned):
            flat = torch.cat([p.reshape(-1) for p in params])
            dist.broadcast(flat, src=owner)
            pieces = flat.split([p.numel() for p in params])
            for param, new in zip(params, pieces, strict=True):
                param.copy_(new.view_as(param))

    def state_bytes(self) -> int:
        return state_bytes(self.optimizer)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in an optimizer's state (moments, momentum buffers,
    step counters)."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def max_weight_gap(model_a: nn.Module, model_b: nn.Module) -> float:
    """Largest |a - b| over all weights and all ranks."""
    gap = max((a - b).abs().max()
              for a, b in zip(model_a.parameters(), model_b.parameters(),
                              strict=True))
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small",
                        help="model size (default: small)")
    parser.add_argument("--steps", type=positive_int, default=5,
                        help="optimizer steps to compare (default: 5)")
    parser.add_argument("--batch-size", type=positive_int, default=8,
                        help="windows per process per step")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    add_backend_and_metrics(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    dataset = corpus_windows(args.steps * world_size * args.batch_size * cfg.context
                             + 1, cfg.vocab_size,
                             cfg.context, args.seed)
    batches = first_batches(dataset, args.batch_size, rank, world_size, args.seed,
                            args.steps, device)
    torch.manual_seed(args.seed)
    start = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in start.parameters())

    for name, (optimizer_class, defaults) in OPTIMIZERS.items():
        models = {way: DDP(copy.deepcopy(start), device_ids=ddp_device_ids(device))
                  for way in ("plain", "sharded", "torch_zero")}
        optimizers = {
            "plain": optimizer_class(models["plain"].parameters(), **defaults),
            "sharded": ShardedOptimizer(models["sharded"].parameters(),
                                        optimizer_class, **defaults),
            "torch_zero": ZeroRedundancyOptimizer(models["torch_zero"].parameters(),
                                                  optimizer_class=optimizer_class,
                                                  **defaults),
        }
        for step, (x, y) in enumerate(batches, 1):
            for way, model in models.items():
                model(x, y).backward()
                optimizers[way].step()
                optimizers[way].zero_grad(set_to_none=True)
            gaps = {way: max_weight_gap(models["plain"].module, models[way].module)
                    for way in ("sharded", "torch_zero")}
            metrics.write(event="step", optimizer=name, step=step,
                          **{f"gap_{k}": v for k, v in gaps.items()})
            if rank == 0:
                print(f"{name} step {step}: max |w_plain - w_sharded| = "
                      f"{gaps['sharded']:.3g}, max |w_plain - "
                      f"w_ZeroRedundancyOptimizer| = {gaps['torch_zero']:.3g}")

        mine = {"rank": rank, "plain": state_bytes(optimizers["plain"]),
                "sharded": optimizers["sharded"].state_bytes(),
                "torch_zero": state_bytes(optimizers["torch_zero"].optim),
                "owned_numel": sum(p.numel()
                                   for p in optimizers["sharded"].owned[rank]),
                "owned_tensors": len(optimizers["sharded"].owned[rank])}
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
        metrics.write(event="state_bytes", optimizer=name, params=n_params,
                      ranks=everyone,
                      largest_param=max(p.numel() for p in start.parameters()))
        if rank == 0:
            for row in everyone:
                print(f"{name} rank {row['rank']}: optimizer state {row['plain']:,} "
                      f"bytes unsharded, {row['sharded']:,} sharded "
                      f"({row['owned_numel']:,} of {n_params:,} parameters)")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
