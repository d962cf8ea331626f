"""What a framework costs per step: plain DDP, Fabric and the Lightning Trainer, timed in one run.

    torchrun --standalone --nproc_per_node=2 scripts/ch6_overhead.py
    torchrun --standalone --nproc_per_node=2 scripts/ch6_overhead.py --model small --steps 40

The same model, data, optimizer and global batch, trained three ways in the same processes and
the same process group: chapter 3's loop around DistributedDataParallel, that loop with Fabric
(fabric.setup, fabric.backward), and Trainer.fit with a minimal LightningModule. Each round runs
every framework for --steps optimizer steps, in turns, so that a slow moment of the machine hits
all three alike; the table shows the median step time of each (the time from one step's end to the
next one's, data loading included) and its ratio to plain DDP. On a shared CPU the ratios are the
result; the absolute times say little about a GPU.
"""

import argparse
import itertools
import os
import statistics
import time
import warnings

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.data import DEFAULTS, corpus_windows, rank_loader
from dtbook.distributed import ddp_device_ids, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_SIZES), default="tiny", help="model size (default: tiny)")
    add("--batch-size", type=positive_int, default=DEFAULTS.batch_size,
        help="windows per process per step (default: 16)")
    add("--steps", type=positive_int, default=20, help="timed steps per framework per round")
    add("--rounds", type=positive_int, default=3, help="rounds of turns (default: 3)")
    add_backend_and_metrics(parser)
    return parser.parse_args()


def step_ends_plain(model, optimizer, loader, steps: int, device, fabric=None) -> list[float]:
    """Chapter 3's loop; with ``fabric``, the same loop with Fabric's two calls."""
    ends = [time.perf_counter()]
    for x, y in loader:
        loss = model(x.to(device), y.to(device))
        if fabric is None:
            loss.backward()
        else:
            fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
        if len(ends) > steps:
            break
    return ends


class TimedGPT(L.LightningModule):
    """The least a LightningModule needs, plus the time at the end of every step."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model, self.ends = model, []

    def training_step(self, batch, batch_idx):
        return self.model(*batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=DEFAULTS.lr)

    def on_train_start(self) -> None:
        self.ends.append(time.perf_counter())

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())


def slowest_rank_median(ends: list[float], device) -> float:
    """The median step time, of the rank whose median is largest (all ranks wait for it)."""
    median = torch.tensor([statistics.median(b - a for a, b in itertools.pairwise(ends))],
                          device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    dataset = corpus_windows(DEFAULTS.corpus_tokens, cfg.vocab_size, cfg.context, DEFAULTS.seed)
    loader = rank_loader(dataset, args.batch_size, rank, world_size, DEFAULTS.seed)
    if len(loader) <= args.steps:
        raise ScriptError(f"--steps must be below the {len(loader)} batches of an epoch")
    accelerator = "cuda" if device.type == "cuda" else "cpu"
    # Fabric and the Trainer find the process group started above and join it, not a new one.
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    fabric = L.Fabric(accelerator=accelerator, devices=per_node,
                      num_nodes=world_size // per_node,
                      strategy=FabricDDP(process_group_backend=backend))
    fabric.launch()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    times: dict[str, list[float]] = {"plain DDP": [], "Fabric": [], "Trainer": []}
    for _ in range(args.rounds):
        model = DDP(GPT(cfg).to(device), device_ids=ddp_device_ids(device))
        optimizer = torch.optim.AdamW(model.parameters(), lr=DEFAULTS.lr)
        ends = step_ends_plain(model, optimizer, loader, args.steps, device)
        times["plain DDP"].append(slowest_rank_median(ends, device))

        module = GPT(cfg)
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(),
                                                                  lr=DEFAULTS.lr))
        ends = step_ends_plain(model, optimizer, loader, args.steps, device, fabric)
        times["Fabric"].append(slowest_rank_median(ends, device))

        timed = TimedGPT(GPT(cfg))
        trainer = L.Trainer(accelerator=accelerator, devices=per_node,
                            num_nodes=world_size // per_node,
                            strategy=DDPStrategy(process_group_backend=backend),
                            max_steps=args.steps, use_distributed_sampler=False,
                            logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(timed, train_dataloaders=loader)
        times["Trainer"].append(slowest_rank_median(timed.ends, device))

    plain = statistics.median(times["plain DDP"])
    if rank == 0:
        print(f"\nGPT-{args.model}, {world_size} process(es) x {args.batch_size} windows, "
              f"{args.steps} steps x {args.rounds} rounds, {backend}/{device.type}")
        print(f"{'framework':<10} {'median step (ms)':>17} {'samples/s':>10} {'vs plain DDP':>13}")
    for name, seconds in times.items():
        step_s = statistics.median(seconds)
        samples_per_s = world_size * args.batch_size / step_s
        metrics.write(event="overhead", framework=name, step_s=step_s,
                      samples_per_s=samples_per_s, ratio_to_plain=step_s / plain,
                      rounds=seconds)
        if rank == 0:
            print(f"{name:<10} {step_s * 1e3:>17.2f} {samples_per_s:>10,.0f} "
                  f"{step_s / plain:>12.2f}x")
    metrics.close()


if __name__ == "__main__":
    run_main(main)
