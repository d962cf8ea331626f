"""Where a data-parallel step's time goes, and what DDP's bucketing and overlap buy over a naive loop.

    torchrun --standalone --nproc_per_node=2 scripts/ch7_step_benchmark.py
    torchrun --standalone --nproc_per_node=2 scripts/ch7_step_benchmark.py --bucket-caps 0.25 1 25
    # one process on each of two machines (the book runs it on chapter 5's cluster lab)
    torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=node0:29500 scripts/ch7_step_benchmark.py

The step is ch3_train.py's (the book's GPT at --model, --batch-size windows per process,
AdamW). For each --batch-size and --bucket-caps value it is timed four ways, in turns:

  T_local  forward, backward and optimizer inside no_sync(): no communication at all;
           its three phases are timed too, for the cost model of chapter 7
  T_ddp    a DDP step: each bucket is all-reduced as soon as its gradients are ready
  T_comm   DDP's buckets all-reduced with nothing else running
  T_naive  no DDP: backward, then one all-reduce per parameter tensor, then divide by
           the world size (the loop one writes first)

  waited   from backward's last gradient until the gradients are averaged: what the
           step waits for after backward, measured directly (a hook notes the last
           gradient; per step the smallest wait over the ranks, since the others also
           wait for the slowest rank's backward)
  exposed = waited_ddp / T_comm        0: hidden behind backward; 1: none of it hidden
           medians, with the 95% bootstrap interval of their ratio over the paired
           steps (dtbook.exposed.exposed_fraction); '-' on one process, on CUDA, with
           fewer than 8 steps, where T_comm is unstable, or where the interval is too
           wide to say anything (the reason is in the metrics).
           The naive loop's wait over the same T_comm
           (naive_over_comm in the metrics, dtbook.exposed.reference_ratio) is the
           no-overlap reference: its communication is per tensor, at least DDP's
           buckets' T_comm, so that ratio is about 1 or more by construction.

Each time is the slowest rank's, the median over --steps steps; p25 and p75 show the spread.
--check-gradients first runs one step both ways from the same weights on the same batch and
reports how far the naive loop's gradients are from DDP's, and, as a control, how far each
rank's own gradients (never averaged) are: a loop that forgot to communicate.
"""

import argparse
import os
import statistics
import time
from functools import partial
from itertools import cycle

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import (
    ScriptError,
    add_backend_and_metrics,
    positive_float,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.ddp_inspect import bucket_sizes
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group
from dtbook.exposed import exposed_fraction, reference_ratio, short
from dtbook.model import GPT, MODEL_SIZES
from dtbook.timing import LastGradientClock, spread, time_in_turns, waited_ms


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_SIZES), default="medium",
        help="model size (default: medium, whose gradients take tens of ms at 1 Gbit/s)")
    add("--batch-size", nargs="+", type=positive_int, default=[2], metavar="N",
        help="windows per process; one table row per value (default 2)")
    add("--bucket-caps", nargs="+", type=positive_float, default=[1.0], metavar="MiB",
        help="one table row per DDP bucket_cap_mb (default: 1)")
    add("--steps", type=positive_int, default=10, help="timed steps per row (default 10)")
    add("--warmup", type=positive_int, default=2, help="untimed steps first (default 2)")
    add("--check-gradients", action="store_true",
        help="compare the naive loop's gradients with DDP's first (needs 2+ processes)")
    add("--seed", type=int, default=DEFAULTS.seed, help="seeds the weights and the data")
    add_backend_and_metrics(parser)
    return parser.parse_args()


def fresh_model(args, device) -> GPT:
    torch.manual_seed(args.seed)  # every model starts from the same weights
    return GPT(MODEL_SIZES[args.model]).to(device)


def naive_all_reduce(model: torch.nn.Module) -> None:
    """Average the gradients after backward: one blocking all-reduce per tensor."""
    world_size = dist.get_world_size()
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= world_size


def naive_step(model, optimizer, data, waits: list | None = None,
               clock: LastGradientClock | None = None) -> None:
    x, y = next(data)
    model(x, y).backward()
    naive_all_reduce(model)  # nothing moves until backward is done
    if waits is not None:
        waits.append(time.perf_counter() - clock.at)
    optimizer.step()
    optimizer.zero_grad()


def ddp_step(ddp, optimizer, data, waits: list | None = None,
             clock: LastGradientClock | None = None) -> None:
    x, y = next(data)
    ddp(x, y).backward()  # buckets are all-reduced while backward runs
    if waits is not None:  # backward returns once the last bucket is averaged
        waits.append(time.perf_counter() - clock.at)
    optimizer.step()
    optimizer.zero_grad()


def local_step(ddp, optimizer, data, phases: list) -> None:
    """The step without communication; appends its phases' (forward, backward,
    optimizer) seconds."""
    x, y = next(data)
    start = time.perf_counter()
    with ddp.no_sync():
        loss = ddp(x, y)
        forward_done = time.perf_counter()
        loss.backward()
    backward_done = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad()
    phases.append((forward_done - start, backward_done - forward_done,
                   time.perf_counter() - backward_done))


def all_reduce_buckets(buffers) -> None:
    """DDP's communication alone: an all-reduce per bucket, all in flight, then wait."""
    for work in [dist.all_reduce(buffer, async_op=True) for buffer in buffers]:
        work.wait()


def slowest_median_ms(values: list[float], device) -> float:
    """The median of this rank's values in ms, then the largest over the ranks."""
    median = torch.tensor(statistics.median(values) * 1000, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def measure(args, cap: float, batches, device) -> dict:
    """The four timings of one bucket cap and batch, with the layout they were taken with."""
    data = cycle(batches)
    ddp = DDP(fresh_model(args, device), device_ids=ddp_device_ids(device),
              bucket_cap_mb=cap)
    ddp_optimizer = torch.optim.AdamW(ddp.parameters(), lr=DEFAULTS.lr)
    model = fresh_model(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEFAULTS.lr)
    # DDP lays its buckets out again after the first backward; time the final layout.
    for _ in range(3):
        ddp_step(ddp, ddp_optimizer, data)
    layout = bucket_sizes(ddp)
    buffers = [torch.randn(n // 4, device=device) for n in layout]  # fp32: 4 bytes each
    phases, waits = [], {"ddp": [], "naive": []}
    ddp_clock, naive_clock = LastGradientClock(ddp.module), LastGradientClock(model)
    functions = {"local": partial(local_step, ddp, ddp_optimizer, data, phases),
                 "ddp": partial(ddp_step, ddp, ddp_optimizer, data, waits["ddp"],
                                ddp_clock),
                 "comm": partial(all_reduce_buckets, buffers),
                 "naive": partial(naive_step, model, optimizer, data, waits["naive"],
                                  naive_clock)}
    samples = time_in_turns(functions, args.steps, args.warmup, device)
    times = {name: spread(ms) for name, ms in samples.items()}
    forward, backward, optimizer_s = zip(*phases[args.warmup:], strict=True)
    row = {"bucket_cap_mb": cap, "buckets": len(layout), "bucket_bytes": layout,
           "tensor_bytes": [p.numel() * p.element_size() for p in model.parameters()],
           "forward_ms": slowest_median_ms(forward, device),
           "backward_ms": slowest_median_ms(backward, device),
           "optimizer_ms": slowest_median_ms(optimizer_s, device)}
    for name, t in times.items():
        row.update({f"t_{name}_ms": t["median"], f"t_{name}_p25_ms": t["p25"],
                    f"t_{name}_p75_ms": t["p75"]})
    for name in ("ddp", "naive"):
        per_step = waited_ms(waits[name], args.warmup, device)
        waited = spread(per_step)
        row.update({f"waited_{name}_ms": waited["median"],
                    f"waited_{name}_p25_ms": waited["p25"],
                    f"waited_{name}_p75_ms": waited["p75"],
                    f"waited_{name}_samples_ms": per_step})
    row["t_comm_samples_ms"] = samples["comm"]
    # the book's one definition: the medians' ratio, its interval, or why there is none
    # (refused on CUDA, where the host clock does not see the wait: dtbook.exposed)
    host_timed = device.type != "cuda"
    row["exposed_ddp"] = exposed_fraction(row["waited_ddp_samples_ms"], samples["comm"],
                                          dist.get_world_size(), host_timed=host_timed)
    # the no-overlap reference: the naive loop's wait in units of DDP's T_comm. Its
    # messages are per tensor, so its own communication takes at least T_comm and this
    # ratio is about 1 or more by construction; DDP's should lie below it.
    row["naive_over_comm"] = reference_ratio(row["waited_naive_samples_ms"],
                                             samples["comm"], host_timed=host_timed)
    return row


def check_gradients(args, batches, device) -> dict:
    """One step from the same weights on the same batch: DDP, the naive loop, no averaging."""
    x, y = batches[0]
    ddp = DDP(fresh_model(args, device), device_ids=ddp_device_ids(device))
    ddp(x, y).backward()
    model = fresh_model(args, device)
    model(x, y).backward()
    own = [p.grad.clone() for p in model.parameters()]
    naive_all_reduce(model)
    reference = [p.grad for p in ddp.parameters()]
    scale = max(g.abs().max().item() for g in reference)

    def largest_difference(grads) -> float:
        return max((g - r).abs().max().item() for g, r in zip(grads, reference, strict=True))

    return {"largest_gradient": scale,
            "naive_relative_difference":
                largest_difference([p.grad for p in model.parameters()]) / scale,
            "control_relative_difference": largest_difference(own) / scale}


def print_table(rows: list[dict]) -> None:
    names = ("local", "ddp", "comm", "naive")
    header = " ".join(f"{'T_' + n + ' ms':>12}" for n in names)
    print(f"{'batch':>5} {'cap MiB':>7} {'buckets':>7} {header} {'waited DDP':>10} "
          f"{'naive':>6} {'exposed (95%)':>17}")
    for r in rows:
        times = " ".join(f"{r[f't_{n}_ms']:>12.1f}" for n in names)
        print(f"{r['batch_size']:>5} {r['bucket_cap_mb']:>7g} {r['buckets']:>7} {times} "
              f"{r['waited_ddp_ms']:>10.1f} {r['waited_naive_ms']:>6.1f} "
              f"{short(r['exposed_ddp']):>17}")


def main() -> None:
    args = parse_args()
    if args.check_gradients and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ScriptError("--check-gradients compares averaged gradients with a rank's own: "
                          "run it on 2 or more processes (torchrun --nproc_per_node=2)")
    backend, device = start_process_group(args.backend, timeout_s=300)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]  # ch3_train.py's data: windows of a synthetic corpus
    dataset = corpus_windows(DEFAULTS.corpus_tokens, cfg.vocab_size, cfg.context, args.seed)
    def batches(batch_size: int) -> list:
        return first_batches(dataset, batch_size, rank, world_size, args.seed, 4, device)

    if args.check_gradients:
        check = check_gradients(args, batches(args.batch_size[0]), device)
        metrics.write(event="gradients", **check)
        if rank == 0:
            print(f"naive loop vs DDP: largest gradient difference "
                  f"{check['naive_relative_difference']:.1e} of the largest gradient; "
                  f"without averaging: {check['control_relative_difference']:.1e}")
    rows = []
    for batch_size in args.batch_size:
        for cap in args.bucket_caps:
            row = {"batch_size": batch_size, **measure(args, cap, batches(batch_size), device)}
            metrics.write(event="step", model=args.model, world_size=world_size, **row)
            rows.append(row)
    if rank == 0:
        print(f"{args.model} model, {world_size} process(es), {backend} on {device.type}; "
              f"{args.steps} timed steps per row; ms, medians (p25-p75 in the metrics); "
              f"exposed '-': see dtbook.exposed (the reason is in the metrics)")
        print_table(rows)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
