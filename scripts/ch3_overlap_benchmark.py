"""How much of DDP's communication is hidden behind the backward pass? Three timings, one table.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_overlap_benchmark.py
    torchrun --standalone --nproc_per_node=2 scripts/ch3_overlap_benchmark.py --bucket-cap-mb 25 default 0.1

For ch3_train.py's step (same model, batch and optimizer), per bucket size:

  T_ddp    a normal DDP step: forward, backward with the bucket all-reduces, optimizer step
  T_local  the same step with communication skipped: forward and backward inside no_sync()
  T_comm   the all-reduces alone: buckets of the sizes DDP chose, all-reduced with nothing else running
  waited   inside each DDP step: from backward's last gradient until the gradients are averaged

  exposed = waited / T_comm                        (dtbook.exposed: the book's measure)
  first look = (T_ddp - T_local) / T_comm          (the same question by subtraction)

0 means the all-reduces are completely hidden behind the backward pass, 1 that they run after it as if
there were no overlap at all. The three take turns, step by step, so that changes in background load
hit them alike; a step is timed from a common start on all ranks to the end of its slowest rank. Each
timing is the median of the --steps x --repeats steps, with its quartiles. The exposed fraction comes
with the 95% bootstrap interval of its ratio of medians over the paired steps, or '-' where there is
none (one process; CUDA, where the host clock does not see the wait; fewer than 8 steps; T_comm
unstable; an interval wider than 0.5: see dtbook.exposed). The first look carries its three terms'
quartiles' worst cases. The default bucket size is ch3_train.py's (25 MiB);
"--bucket-cap-mb default" leaves DDP's own layout (no bucket_cap_mb argument).
"""

import argparse
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
from dtbook.exposed import exposed_fraction, first_look, short
from dtbook.model import GPT, MODEL_SIZES
from dtbook.timing import LastGradientClock, spread, time_in_turns, waited_ms


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


def train_step(ddp, optimizer, data, skip_communication: bool, waits: list | None = None,
               clock: LastGradientClock | None = None) -> None:
    x, y = next(data)
    if skip_communication:
        # Gradients stay local: no bucket is all-reduced. The replicas drift apart, which
        # changes nothing about how long a step takes.
        with ddp.no_sync():
            ddp(x, y).backward()
    else:
        ddp(x, y).backward()  # returns once every bucket's average is in .grad
        if waits is not None:  # the wait no computation hid, from the last gradient on
            waits.append(time.perf_counter() - clock.at)
    optimizer.step()
    optimizer.zero_grad()


def all_reduce_buckets(buffers) -> None:
    """What DDP's communication amounts to: one all-reduce per bucket, all in flight, then wait for them."""
    works = [dist.all_reduce(buffer, async_op=True) for buffer in buffers]
    for work in works:
        work.wait()


def measure(args, cap, batches, device) -> dict:
    """T_ddp, T_local, T_comm and waited at one bucket cap, every round's steps."""
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

    clock = LastGradientClock(ddp.module)
    samples = {"ddp": [], "local": [], "comm": [], "waited": []}
    for _ in range(args.repeats):
        waits = []
        functions = {"ddp": partial(train_step, ddp, optimizer, data, False, waits,
                                    clock),
                     "local": partial(train_step, ddp, optimizer, data, True),
                     "comm": partial(all_reduce_buckets, buffers)}
        times = time_in_turns(functions, args.steps, args.warmup, device)
        for name, ms in times.items():
            samples[name] += ms
        samples["waited"] += waited_ms(waits, args.warmup, device)
    t = {name: spread(ms) for name, ms in samples.items()}
    row = {"bucket_cap_mb": cap, "buckets": len(bucket_bytes),
           "gradient_mb": sum(bucket_bytes) / 2**20}
    for name, s in t.items():
        key = name if name == "waited" else f"t_{name}"
        row.update({f"{key}_ms": s["median"], f"{key}_p25_ms": s["p25"],
                    f"{key}_p75_ms": s["p75"], f"{key}_samples_ms": samples[name]})
    # on CUDA the host clock does not see the wait (dtbook.exposed): the
    # fraction is refused
    row["exposed"] = exposed_fraction(samples["waited"], samples["comm"],
                                      dist.get_world_size(),
                                      host_timed=device.type != "cuda")
    row["first_look"] = first_look(t["ddp"], t["local"], t["comm"])
    return row


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
              f"{device.type}; medians of {args.steps} steps x {args.repeats} rounds; fractions: (p25-p75)")
        print(f"{'bucket_cap_mb':>13} {'buckets':>7} {'T_ddp ms':>9} {'T_local ms':>10} {'T_comm ms':>9} "
              f"{'waited ms':>9} {'exposed waited/T_comm':>22} {'first look (T_ddp-T_local)/T_comm':>34}")
        for r in rows:
            cap = "default" if r["bucket_cap_mb"] is None else f"{r['bucket_cap_mb']:g}"
            look = r["first_look"]
            print(f"{cap:>13} {r['buckets']:>7} {r['t_ddp_ms']:>9.2f} {r['t_local_ms']:>10.2f} "
                  f"{r['t_comm_ms']:>9.2f} {r['waited_ms']:>9.2f} {short(r['exposed']):>22} "
                  f"{look['fraction']:>14.2f} ({look['low']:.2f}-{look['high']:.2f})")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
