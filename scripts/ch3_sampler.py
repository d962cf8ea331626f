"""DistributedSampler up close, and how many samples one optimizer step really sees.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_sampler.py

Part 1 asks DistributedSampler, on every rank, which dataset indices it hands
out for a small dataset (``--dataset-size``, deliberately not a multiple of
the world size): without shuffling, with ``drop_last`` off and on, and for
several epochs with shuffling, with and without ``set_epoch`` and with
``drop_last``. Rank 0 records every rank's list.

Part 2 trains a tiny GPT for ``--steps`` optimizer steps with DDP, a per-process
batch of ``--batch-size`` and ``--accum-steps`` micro-batches per step (all but
the last under ``no_sync``). At each step the ranks count and pool the
samples they used, and rank 0 checks the DDP gradient against one process
computing the loss on that whole pool: the effective batch is
batch size x accumulation steps x world size.
"""

import argparse
import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from dtbook.cli import add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.data import TokenWindows, synthetic_corpus
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group
from dtbook.metrics import MetricsWriter
from dtbook.model import GPT, MODEL_SIZES


class Numbered(Dataset):
    """Wraps a dataset so each item comes with its index, letting the loop report what it used."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return i, *self.dataset[i]


def gather(obj) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def show_shards(args, metrics: MetricsWriter) -> None:
    """Part 1: the indices each rank gets, case by case."""
    dataset = range(args.dataset_size)  # the sampler needs only len(dataset)
    cases = [("in order, padded", dict(shuffle=False, drop_last=False), False),
             ("in order, drop_last", dict(shuffle=False, drop_last=True), False),
             ("shuffled, set_epoch", dict(shuffle=True, drop_last=False), True),
             ("shuffled, no set_epoch", dict(shuffle=True, drop_last=False), False),
             ("shuffled, drop_last", dict(shuffle=True, drop_last=True), True)]
    for name, options, calls_set_epoch in cases:
        sampler = DistributedSampler(dataset, seed=args.seed, **options)
        epochs = args.epochs if options["shuffle"] else 1
        for epoch in range(epochs):
            if calls_set_epoch:
                sampler.set_epoch(epoch)  # reseeds the shuffle with seed + epoch
            shards = gather([int(i) for i in sampler])
            for rank, shard in enumerate(shards):
                metrics.write(event="shard", case=name, epoch=epoch, rank=rank,
                              indices=shard, num_samples=sampler.num_samples,
                              total_size=sampler.total_size, **options)
            if dist.get_rank() == 0:
                each = " | ".join(f"rank {r}: {s}" for r, s in enumerate(shards))
                print(f"{name:<22} epoch {epoch}: {each}")


def count_effective_batch(args, device: torch.device, metrics: MetricsWriter):
    """Part 2: train with accumulation; count what each optimizer step consumed."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = MODEL_SIZES["tiny"]
    windows_needed = args.steps * args.batch_size * args.accum_steps * world_size
    tokens = synthetic_corpus(windows_needed * cfg.context + 1, cfg.vocab_size,
                              args.seed)
    windows = Numbered(TokenWindows(tokens, cfg.context))
    sampler = DistributedSampler(windows, shuffle=True, seed=args.seed,
                                 drop_last=True)
    loader = DataLoader(windows, batch_size=args.batch_size, sampler=sampler,
                        drop_last=True)

    torch.manual_seed(args.seed)
    model = DDP(GPT(cfg).to(device), device_ids=ddp_device_ids(device))
    one_process = copy.deepcopy(model.module)  # the same model on one "big" process
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    sampler.set_epoch(0)
    used: list[int] = []
    step = 0
    for micro, (index, inputs, targets) in enumerate(loader):
        last_micro = (micro + 1) % args.accum_steps == 0
        # No all-reduce but on the last micro-batch: gradients accumulate locally.
        with nullcontext() if last_micro else model.no_sync():
            loss = model(inputs.to(device), targets.to(device)) / args.accum_steps
            loss.backward()
        used += index.tolist()
        if not last_micro:
            continue

        count = torch.tensor([len(used)], device=device)
        dist.all_reduce(count)
        pooled = [i for shard in gather(used) for i in shard]
        one_process.load_state_dict(model.module.state_dict())
        one_process.zero_grad()
        pooled_inputs = torch.stack([windows[i][1] for i in pooled]).to(device)
        pooled_targets = torch.stack([windows[i][2] for i in pooled]).to(device)
        one_process(pooled_inputs, pooled_targets).backward()
        pairs = zip(model.parameters(), one_process.parameters(), strict=True)
        gap = max((p.grad - q.grad).abs().max().item() for p, q in pairs)
        largest = max(q.grad.abs().max().item() for q in one_process.parameters())
        metrics.write(event="optimizer_step", step=step, samples=int(count.item()),
                      distinct=len(set(pooled)), per_process_batch=args.batch_size,
                      accum_steps=args.accum_steps, world_size=world_size,
                      max_grad_diff_vs_one_process=gap, max_abs_grad=largest,
                      indices=pooled)
        if rank == 0:
            print(f"optimizer step {step}: {int(count.item())} samples "
                  f"({len(set(pooled))} distinct) = "
                  f"{args.batch_size} x {args.accum_steps} x {world_size}; "
                  f"max|g_ddp - g_one_process_on_all_of_them| = {gap:.3g}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        used = []
        step += 1


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--dataset-size", type=positive_int, default=11, help="items in part 1's dataset")
    parser.add_argument("--epochs", type=positive_int, default=3, help="epochs to draw in part 1")
    parser.add_argument("--batch-size", type=positive_int, default=2,
                        help="part 2: sequences per process per micro-batch")
    parser.add_argument("--accum-steps", type=positive_int, default=2,
                        help="part 2: micro-batches per optimizer step")
    parser.add_argument("--steps", type=positive_int, default=3, help="part 2: optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    add_backend_and_metrics(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    metrics = open_metrics(args.metrics, backend, device)
    show_shards(args, metrics)
    count_effective_batch(args, device, metrics)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
