"""How much of DDP's communication is hidden behind the backward pass? Three timings, one table.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_overlap_benchmark.py
    torchrun --standalone --nproc_per_node=2 scripts/ch3_overlap_benchmark.py --bucket-cap-mb 25 default 0.1

For ch3_train.py's step (same model, batch and optimizer), per bucket size:

  T_ddp    a normal DDP step: forward, backward with the bucket all-reduces, optimizer step
  T_local  the same step with communication skipped: forward and backward inside no_sync()
  T_comm   the all-reduces alone: buckets of the sizes DDP chose, all-reduced with nothing else running

  exposed = (T_ddp - T_local) / T_comm

0 means the all-reduces are completely hidden behind the backward pass, 1 that they run after it as if
there were no overlap at all. The three take turns, step by step, so that changes in background load
hit them alike; a step is timed from a common start on all ranks to the end of its slowest rank. Each
timing is the median over --steps steps, then over --repeats rounds. The default bucket size is
ch3_train.py's (25 MiB); "--bucket-cap-mb default" leaves DDP's own layout (no bucket_cap_mb argument).
"""

import argparse
import statistics
import time
from functools import partial
from itertools import cycle

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import add_backend_and_metrics, positive_float, positive_int, run_main, script_parser
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.ddp_inspect import bucket_sizes
from dtbook.distributed import (
    ddp_device_ids,
    drain_gloo_workers,
    open_metrics,
    require_gpu_for,
    start_process_group,
)
from dtbook.model import GPT, MODEL_SIZES


def bucket_cap(text: str) -> float | None:
    """argparse type: a bucket size in MiB, or 'default' for DDP's layout (no bucket_cap_mb argument)."""
    return None if text == "default" else positive_float(text)


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small", help="model size (default: small)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="samples per process (default 16)")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per measurement (default 10)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="rounds of the three measurements (default 3)")
    parser.add_argument("--warmup", type=positive_int, default=2,
                        help="untimed steps before each measurement (default 2)")
    parser.add_argument("--bucket-cap-mb", nargs="+", type=bucket_cap, default=[DEFAULTS.bucket_cap_mb], metavar="MiB",
                        help=f"one table row per bucket size; 'default' is DDP's own layout, without "
                             f"bucket_cap_mb (default: {DEFAULTS.bucket_cap_mb:g}, as ch3_train.py)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    add_backend_and_metrics(parser)
    return parser.parse_args()


def step_times_ms(functions: dict, args, device) -> dict:
    """Wall times of each function, called in turn --steps times after --warmup untimed turns.

    Every call starts on all ranks at once (an untimed barrier) and lasts until the slowest rank is
    done, as a synchronized training step does. Taking turns exposes all three measurements to the
    same background load, which on a shared machine changes from one second to the next.
    """
    for _ in range(args.warmup):
        for fn in functions.values():
            fn()
    times = {name: [] for name in functions}
    for _ in range(args.steps):
        for name, fn in functions.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - start) * 1000)
    slowest = {}
    for name, ms in times.items():
        per_step = torch.tensor(ms, device=device)
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
        slowest[name] = per_step.tolist()
    return slowest


def train_step(ddp, optimizer, data, skip_communication: bool) -> None:
    x, y = next(data)
    if skip_communication:
        # Gradients stay local: no bucket is all-reduced. The replicas drift apart, which
        # changes nothing about how long a step takes.
        with ddp.no_sync():
            ddp(x, y).backward()
    else:
        ddp(x, y).backward()
    optimizer.step()
    optimizer.zero_grad()


def all_reduce_buckets(buffers) -> None:
    """What DDP's communication amounts to: one all-reduce per bucket, all in flight, then wait for them."""
    works = [dist.all_reduce(buffer, async_op=True) for buffer in buffers]
    for work in works:
        work.wait()


def measure(args, cap, batches, device) -> dict:
    """T_ddp, T_local and T_comm for one bucket size."""
    torch.manual_seed(args.seed)
    model = GPT(MODEL_SIZES[args.model]).to(device)
    ddp = DDP(model, device_ids=ddp_device_ids(device),
              **({} if cap is None else {"bucket_cap_mb": cap}))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=DEFAULTS.lr)
    data = cycle(batches)
    # DDP lays its buckets out again in the second forward, and reports the new
    # layout from the third on.
    for _ in range(3):
        train_step(ddp, optimizer, data, skip_communication=False)
    bucket_bytes = bucket_sizes(ddp)
    # fp32: 4 bytes per element
    buffers = [torch.randn(n // 4, device=device) for n in bucket_bytes]

    functions = {"ddp": partial(train_step, ddp, optimizer, data, False),
                 "local": partial(train_step, ddp, optimizer, data, True),
                 "comm": partial(all_reduce_buckets, buffers)}
    medians = {name: [] for name in functions}
    for _ in range(args.repeats):
        for name, ms in step_times_ms(functions, args, device).items():
            medians[name].append(statistics.median(ms))
    t_ddp, t_local, t_comm = (statistics.median(medians[name]) for name in functions)
    return {"bucket_cap_mb": cap, "buckets": len(bucket_bytes),
            "gradient_mb": sum(bucket_bytes) / 2**20,
            "t_ddp_ms": t_ddp, "t_local_ms": t_local, "t_comm_ms": t_comm,
            "exposed_fraction": (t_ddp - t_local) / t_comm}


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    require_gpu_for(args.model, device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    # DDP's cap on its first bucket when no bucket_cap_mb is given, for comparing the rows' gradients
    # with it without importing torch where the metrics are read.
    metrics.write(event="ddp_defaults", first_bucket_bytes=dist._DEFAULT_FIRST_BUCKET_BYTES)

    cfg = MODEL_SIZES[args.model]  # the data of ch3_train.py: windows of a synthetic corpus, split by rank
    dataset = corpus_windows(DEFAULTS.corpus_tokens, cfg.vocab_size, cfg.context, args.seed)
    batches = first_batches(dataset, args.batch_size, rank, world_size, args.seed, 4, device)

    rows = []
    for cap in args.bucket_cap_mb:
        row = measure(args, cap, batches, device)
        rows.append(row)
        metrics.write(event="overlap", model=args.model, batch_size=args.batch_size, **row)

    if rank == 0:
        print(f"{args.model} model, batch {args.batch_size} per process, {world_size} process(es), {backend} on "
              f"{device.type}; medians of {args.steps} steps x {args.repeats} rounds")
        print(f"{'bucket_cap_mb':>13} {'buckets':>7} {'grad MiB':>8} {'T_ddp ms':>9} {'T_local ms':>10} "
              f"{'T_comm ms':>9} {'exposed (T_ddp-T_local)/T_comm':>30}")
        for r in rows:
            cap = "default" if r["bucket_cap_mb"] is None else f"{r['bucket_cap_mb']:g}"
            print(f"{cap:>13} {r['buckets']:>7} {r['gradient_mb']:>8.2f} {r['t_ddp_ms']:>9.2f} "
                  f"{r['t_local_ms']:>10.2f} {r['t_comm_ms']:>9.2f} {r['exposed_fraction']:>30.2f}")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
