"""What communication costs between nodes: all-reduce, buckets, overlap,
accumulation.

    # one process on each of two nodes (the book runs it on its cluster lab)
    torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=node0:29500 scripts/ch5_link_benchmark.py
    torchrun --standalone --nproc_per_node=2 scripts/ch5_link_benchmark.py \\
        --experiments overlap

Every experiment trains the chapter's model (ch3_train.py's GPT at --model,
--batch-size windows per process, AdamW) and changes one thing:

  allreduce     all_reduce of --sizes-mib MiB: time, algorithm and bus bandwidth
  buckets       DDP step time for each --bucket-caps value (MiB)
  overlap       four step times at --bucket-cap-mb:
                  T_ddp    a DDP step: backward with the buckets' all-reduces overlapped
                  T_local  the same step inside no_sync(): no communication at all
                  T_comm   the buckets' all-reduces alone, nothing else running
                  T_after  backward first, then the same all-reduces: no overlap
                exposed = waited / T_comm, for DDP and for the loop without
                overlap: waited is the time from backward's last gradient to the
                averaged gradients, measured inside the step (dtbook.exposed: the
                medians' ratio with its 95% bootstrap interval over the steps)
  accumulation  one optimizer step of --accum-steps micro-batches: all-reduce after
                every micro-batch, or only after the last (no_sync)
  compression   DDP step time with no hook, fp16_compress_hook and bf16_compress_hook

Times are medians over --steps steps of the slowest rank; the configurations of an
experiment take turns step by step, so changes in background load hit them alike.
"""

import argparse
import statistics
import time
from contextlib import nullcontext
from functools import partial
from itertools import cycle

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import (
    add_backend_and_metrics,
    positive_float,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.ddp_inspect import bucket_sizes
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group
from dtbook.exposed import exposed_fraction
from dtbook.model import GPT, MODEL_SIZES
from dtbook.timing import LastGradientClock, spread, time_in_turns, waited_ms

EXPERIMENTS = ["allreduce", "buckets", "overlap", "accumulation", "compression"]


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--experiments", nargs="+", choices=EXPERIMENTS, default=EXPERIMENTS,
        metavar="NAME",
        help=f"which to run (default: all of {', '.join(EXPERIMENTS)})")
    add("--model", choices=sorted(MODEL_SIZES), default="medium",
        help="model size (default: medium, whose gradients take tens of ms at 1 "
             "Gbit/s)")
    add("--batch-size", type=positive_int, default=2,
        help="windows per process (default 2: little compute, so communication "
             "shows)")
    add("--steps", type=positive_int, default=10,
        help="timed steps per configuration (default 10)")
    add("--warmup", type=positive_int, default=2,
        help="untimed steps first (default 2)")
    add("--sizes-mib", nargs="+", type=positive_float, default=[0.25, 1, 4, 16],
        metavar="MiB", help="all_reduce message sizes (default: 0.25 1 4 16)")
    add("--bucket-caps", nargs="+", type=positive_float,
        default=[0.05, 0.25, 1, 4, 25],
        metavar="MiB", help="bucket_cap_mb values for the bucket sweep")
    add("--bucket-cap-mb", type=positive_float, default=1.0,
        help="bucket size for the other experiments (default 1)")
    add("--accum-steps", type=positive_int, default=4,
        help="micro-batches per optimizer step, accumulation experiment (default 4)")
    add("--seed", type=int, default=DEFAULTS.seed,
        help="seeds the weights and the data")
    add_backend_and_metrics(parser)
    return parser.parse_args()


def median_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ms) for name, ms in times.items()}


def median_and_quartiles(ms: list[float]) -> dict[str, float]:
    """The median step and the p25-p75 spread that any difference between
    settings must beat."""
    step = spread(ms)
    return {"step_ms": step["median"], "p25_ms": step["p25"], "p75_ms": step["p75"]}


def build(args, device, **ddp_options):
    """A fresh DDP model from the same seed, and its optimizer."""
    torch.manual_seed(args.seed)
    ddp = DDP(GPT(MODEL_SIZES[args.model]).to(device),
              device_ids=ddp_device_ids(device),
              **ddp_options)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=DEFAULTS.lr)


def train_step(ddp, optimizer, data, communicate: bool = True,
               waits: list | None = None,
               clock: LastGradientClock | None = None) -> None:
    """One step; with ``waits``, also how long backward ran on after its last
    gradient.

    That is the time DDP's backward waits for the buckets' all-reduces still in
    flight: communication that no computation hid.
    """
    x, y = next(data)
    with nullcontext() if communicate else ddp.no_sync():
        ddp(x, y).backward()
    if waits is not None:
        waits.append(time.perf_counter() - clock.at)
    optimizer.step()
    optimizer.zero_grad()


def all_reduce_each(buffers) -> None:
    """DDP's communication: one all-reduce per bucket, all in flight, then wait."""
    for work in [dist.all_reduce(buffer, async_op=True) for buffer in buffers]:
        work.wait()


def after_backward_step(ddp, optimizer, data, bucket_bytes: list[int], waits: list,
                        clock: LastGradientClock) -> None:
    """Data parallelism without overlap: finish backward, then average the gradients.

    The gradients are cut into DDP's bucket sizes, so the messages are the same
    as DDP's: the one difference is that not one byte moves until backward is
    done.
    """
    x, y = next(data)
    with ddp.no_sync():
        ddp(x, y).backward()
    grads = [p.grad for p in ddp.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce_each(flat.split([n // flat.element_size() for n in bucket_bytes]))
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    waits.append(time.perf_counter() - clock.at)
    optimizer.step()
    optimizer.zero_grad()


def warm_layout(ddp, optimizer, data) -> list[int]:
    """DDP lays its buckets out again after the first backward; return the new
    layout."""
    for _ in range(3):
        train_step(ddp, optimizer, data)
    return bucket_sizes(ddp)


# --------------------------------------------------------------------------
# The experiments
# --------------------------------------------------------------------------


def run_allreduce(args, device, batches, report) -> None:
    world = dist.get_world_size()
    buffers = {mib: torch.ones(int(mib * 2**20) // 4, device=device)
               for mib in args.sizes_mib}
    functions = {mib: partial(dist.all_reduce, buffer)
                 for mib, buffer in buffers.items()}
    times = median_ms(time_in_turns(functions, args.steps, args.warmup, device))
    for mib, ms in times.items():
        algbw = mib * 2**20 / (ms / 1000) / 1e9
        # Ring all-reduce: every rank sends and receives 2 (n-1)/n of the message.
        report("allreduce", size_mib=mib, ms=ms, algbw_gbs=algbw,
               busbw_gbs=algbw * 2 * (world - 1) / world)


def run_buckets(args, device, batches, report) -> None:
    models = {cap: build(args, device, bucket_cap_mb=cap)
              for cap in args.bucket_caps}
    data = cycle(batches)
    layouts = {cap: warm_layout(ddp, opt, data)
               for cap, (ddp, opt) in models.items()}
    steps = {cap: partial(train_step, ddp, opt, data)
             for cap, (ddp, opt) in models.items()}
    times = time_in_turns(steps, args.steps, args.warmup, device)
    for cap, ms in times.items():
        report("buckets", bucket_cap_mb=cap, buckets=len(layouts[cap]),
               **median_and_quartiles(ms))


def exposed_ms(waits: list[float], warmup: int, device) -> float:
    """Median over the timed steps of the smallest wait on any rank, in ms."""
    return statistics.median(waited_ms(waits, warmup, device))


def run_overlap(args, device, batches, report) -> None:
    ddp, optimizer = build(args, device, bucket_cap_mb=args.bucket_cap_mb)
    clock = LastGradientClock(ddp.module)
    data = cycle(batches)
    layout = warm_layout(ddp, optimizer, data)
    # fp32: 4 bytes each
    buffers = [torch.randn(n // 4, device=device) for n in layout]
    ddp_waits, after_waits = [], []
    functions = {"ddp": partial(train_step, ddp, optimizer, data, True, ddp_waits,
                                clock),
                 "local": partial(train_step, ddp, optimizer, data,
                                  communicate=False),
                 "comm": partial(all_reduce_each, buffers),
                 "after": partial(after_backward_step, ddp, optimizer, data, layout,
                                  after_waits, clock)}
    samples = time_in_turns(functions, args.steps, args.warmup, device)
    waited = {"ddp": waited_ms(ddp_waits, args.warmup, device),
              "after": waited_ms(after_waits, args.warmup, device)}
    spreads = {f"t_{name}": spread(ms) for name, ms in samples.items()}
    spreads |= {f"waited_{name}": spread(ms) for name, ms in waited.items()}
    world_size = dist.get_world_size()
    report("overlap", bucket_cap_mb=args.bucket_cap_mb, buckets=len(layout),
           gradient_mib=sum(layout) / 2**20,
           **{f"{term}_ms": s["median"] for term, s in spreads.items()},
           **{f"{term}_{q}_ms": s[q] for term, s in spreads.items()
              for q in ("p25", "p75")},
           **{f"waited_{name}_samples_ms": ms for name, ms in waited.items()},
           t_comm_samples_ms=samples["comm"],
           # the book's exposed fraction (dtbook.exposed), with its interval
           # (refused on CUDA, where the host clock does not see the wait)
           exposed_ddp=exposed_fraction(waited["ddp"], samples["comm"], world_size,
                                        host_timed=device.type != "cuda"),
           exposed_after=exposed_fraction(waited["after"], samples["comm"],
                                          world_size, host_timed=device.type != "cuda"))


def accumulation_step(ddp, optimizer, data, accum_steps: int,
                      use_no_sync: bool) -> None:
    for micro in range(accum_steps):
        x, y = next(data)
        last = micro == accum_steps - 1
        with ddp.no_sync() if use_no_sync and not last else nullcontext():
            (ddp(x, y) / accum_steps).backward()
    optimizer.step()
    optimizer.zero_grad()


def run_accumulation(args, device, batches, report) -> None:
    ddp, optimizer = build(args, device, bucket_cap_mb=args.bucket_cap_mb)
    clock = LastGradientClock(ddp.module)
    data = cycle(batches)
    warm_layout(ddp, optimizer, data)
    accumulate = partial(accumulation_step, ddp, optimizer, data, args.accum_steps)
    waits = []
    functions = {"every": partial(accumulate, use_no_sync=False),
                 "no_sync": partial(accumulate, use_no_sync=True),
                 "ddp": partial(train_step, ddp, optimizer, data, True, waits,
                                clock)}
    t = median_ms(time_in_turns(functions, args.steps, args.warmup, device))
    # Each all-reduce skipped saves the communication a step exposes, measured
    # directly.
    predicted = (args.accum_steps - 1) * exposed_ms(waits, args.warmup, device)
    report("accumulation", accum_steps=args.accum_steps, every_ms=t["every"],
           no_sync_ms=t["no_sync"], saved_ms=t["every"] - t["no_sync"],
           predicted_saving_ms=predicted)


def bf16_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """bf16_compress_hook under another name.

    DDP refuses the hook by name unless CUDA and NCCL are present, yet gloo reduces
    bfloat16 on the CPU: called through this function, the hook runs unchanged.
    """
    return default_hooks.bf16_compress_hook(state, bucket)


def run_compression(args, device, batches, report) -> None:
    hooks = {"none": None, "fp16": default_hooks.fp16_compress_hook,
             "bf16": bf16_hook}
    models = {}
    for name, hook in hooks.items():
        ddp, optimizer = build(args, device, bucket_cap_mb=args.bucket_cap_mb)
        if hook is not None:
            # The hook casts each bucket to 16 bits, all-reduces it, casts the mean
            # back.
            ddp.register_comm_hook(state=None, hook=hook)
        models[name] = (ddp, optimizer)
    data = cycle(batches)
    for ddp, optimizer in models.values():
        warm_layout(ddp, optimizer, data)
    steps = {name: partial(train_step, ddp, opt, data)
             for name, (ddp, opt) in models.items()}
    times = time_in_turns(steps, args.steps, args.warmup, device)
    for name, ms in times.items():
        report("compression", hook=name, **median_and_quartiles(ms),
               bytes_per_element=4 if name == "none" else 2)


RUNNERS = {"allreduce": run_allreduce, "buckets": run_buckets,
           "overlap": run_overlap,
           "accumulation": run_accumulation, "compression": run_compression}


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend, timeout_s=300)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    dataset = corpus_windows(DEFAULTS.corpus_tokens, cfg.vocab_size, cfg.context,
                             args.seed)
    batches = first_batches(dataset, args.batch_size, rank, world_size, args.seed, 4,
                            device)

    def report(experiment: str, **row) -> None:
        metrics.write(event=experiment, **row)
        if rank == 0:
            shown = (f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in row.items())
            print(f"{experiment:>12}: " + "  ".join(shown), flush=True)

    if rank == 0:
        print(f"{args.model} model, batch {args.batch_size} per process, "
              f"{world_size} processes, {backend} on {device.type}; medians of "
              f"{args.steps} steps",
              flush=True)
    for name in args.experiments:
        RUNNERS[name](args, device, batches, report)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
