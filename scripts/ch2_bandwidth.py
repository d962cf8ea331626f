"""Latency and bandwidth of four collectives over message sizes, and an alpha-beta model fitted.

    torchrun --standalone --nproc_per_node=2 scripts/ch2_bandwidth.py
    torchrun --standalone --nproc_per_node=2 scripts/ch2_bandwidth.py --max-bytes 1MiB

For each collective and message size S the table shows, as nccl-tests defines them
(GB/s = 1e9 bytes per second):

  time    seconds per call: the median of --rounds rounds of back-to-back calls, each
          round starting on all ranks together and ending when its slowest rank is done
          (fewer rounds, but at least 3, where --size-seconds would not hold them all)
  algbw   algorithm bandwidth, S / time
  busbw   bus bandwidth, algbw * b, with b = 2(N-1)/N for all_reduce, (N-1)/N for
          all_gather and reduce_scatter, 1 for broadcast: the rate at which each rank's
          link carries data, comparable across collectives and numbers of processes N

S is the float32 tensor every rank holds (all_reduce, broadcast), the gathered output
(all_gather), or each rank's input (reduce_scatter). Before the sweep every rank times
torch.Tensor.copy_ of a --copy-bytes buffer, all at once: the memory-copy bandwidth that
data moving between processes on one machine cannot beat. After it, rank 0 fits
t = a * alpha + b * S * beta (scripts/dtbook/cost_model.py) to the times of
--fit-collectives (default: all_reduce, the collective of DDP) and saves the model as
JSON (--model-out), from which later chapters predict communication times.
"""

import argparse
import os
import statistics
from functools import partial

import torch
import torch.distributed as dist

from dtbook.cli import (
    ScriptError,
    add_backend_and_metrics,
    byte_size,
    format_bytes,
    positive_float,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.comm_timing import calls_per_round, seconds_per_call
from dtbook.cost_model import COLLECTIVES, MODEL_FILE, AlphaBeta, Measurement, bus_bandwidth
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group

FLOAT32_BYTES = 4


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES),
        help="which to measure (default: all four)")
    add("--min-bytes", type=byte_size, default=4, help="smallest message: 4, 64KiB, ... (default 4)")
    add("--max-bytes", type=byte_size, default=256 * 2**20, help="largest message (default 256MiB)")
    add("--step", type=positive_int, default=4, help="each size is this many times the last (default 4)")
    add("--rounds", type=positive_int, default=5, help="timed rounds per size, median kept (default 5)")
    add("--size-seconds", type=positive_float, default=3.0,
        help="fewer rounds (at least 3) where --rounds would take longer than this (default 3)")
    add("--round-seconds", type=positive_float, default=0.02,
        help="a round makes as many calls as fill this many seconds, at least 1 (default 0.02)")
    add("--max-calls", type=positive_int, default=200, help="at most this many calls per round")
    add("--copy-bytes", type=byte_size, default=256 * 2**20,
        help="buffer for the memory-copy ceiling (default 256MiB)")
    add("--fit-collectives", nargs="+", choices=COLLECTIVES, default=["all_reduce"],
        help="fit the model to the times of these (default: all_reduce)")
    add("--model-out", default=str(MODEL_FILE), help=f"where to save the fit (default {MODEL_FILE})")
    add_backend_and_metrics(parser)
    args = parser.parse_args()
    if args.min_bytes > args.max_bytes:
        raise ScriptError(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if not set(args.fit_collectives) <= set(args.collectives):
        raise ScriptError(f"--fit-collectives {' '.join(args.fit_collectives)}: fit only what "
                          f"--collectives measures ({' '.join(args.collectives)})")
    if args.step < 2:
        raise ScriptError("--step must be at least 2, or the sweep never reaches --max-bytes")
    return args


def message_elements(args, world_size: int) -> list[int]:
    """float32 element counts of the sweep, each a multiple of the world size (for all_gather)."""
    counts, nbytes = [], args.min_bytes
    while nbytes <= args.max_bytes:
        count = max(world_size, nbytes // FLOAT32_BYTES // world_size * world_size)
        if count not in counts:
            counts.append(count)
        nbytes *= args.step
    return counts


def collective_call(name: str, elements: int, device: torch.device):
    """A function of no arguments that runs collective ``name`` on ``elements`` floats."""
    world_size = dist.get_world_size()
    full = torch.ones(elements, device=device)
    shard = torch.ones(elements // world_size, device=device)
    if name == "all_reduce":
        return partial(dist.all_reduce, full)
    if name == "all_gather":  # every rank contributes a shard and receives all of them
        return partial(dist.all_gather_single, full, shard)
    if name == "reduce_scatter":  # every rank contributes all, keeps one reduced shard
        return partial(dist.reduce_scatter_single, shard, full)
    return partial(dist.broadcast, full, src=0)


def copy_bandwidth(nbytes: int, rounds: int, device: torch.device) -> float:
    """Bytes per second that Tensor.copy_ moves on each rank while all of them
    copy."""
    source = torch.ones(nbytes // FLOAT32_BYTES, device=device)
    target = torch.empty_like(source)
    copy = partial(target.copy_, source)
    per_round = seconds_per_call(copy, calls=1, rounds=rounds + 1, device=device)
    # the first copy also maps the target's fresh pages: not timed
    timed = per_round[1:]
    return source.numel() * FLOAT32_BYTES / statistics.median(timed)


def sweep(args, device: torch.device) -> list[dict]:
    """Time every collective at every size: one row per (collective, size)."""
    world_size = dist.get_world_size()
    rows = []
    for name in args.collectives:
        for elements in message_elements(args, world_size):
            call = collective_call(name, elements, device)
            calls, first = calls_per_round(call, args.round_seconds, args.max_calls, device)
            rounds = max(3, min(args.rounds, int(args.size_seconds / (calls * first))))
            per_call = seconds_per_call(call, calls, rounds, device)
            seconds, nbytes = statistics.median(per_call), elements * FLOAT32_BYTES
            rows.append({"collective": name, "world_size": world_size, "nbytes": nbytes,
                         "seconds": seconds, "calls_per_round": calls, "rounds": rounds,
                         "round_seconds": per_call,
                         "algbw_GBps": nbytes / seconds / 1e9,
                         "busbw_GBps": bus_bandwidth(name, world_size, nbytes, seconds) / 1e9})
            del call  # free this size's tensors before allocating the next, larger ones
    return rows


def measurement(row: dict) -> Measurement:
    return Measurement(row["collective"], row["world_size"], row["nbytes"], row["seconds"])


def print_table(rows: list[dict], model: AlphaBeta | None) -> None:
    """One row per size, the collectives side by side: time and bus bandwidth of each."""
    collectives = list(dict.fromkeys(r["collective"] for r in rows))
    by_size: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_size.setdefault(r["nbytes"], {})[r["collective"]] = r
    print(f"{'':>9}" + "".join(f" {c:>17}" for c in collectives))
    print(f"{'size':>9}" + "".join(f" {'us':>10} {'busbw':>6}" for c in collectives)
          + "   (busbw: GB/s)")
    for nbytes, cells in by_size.items():
        print(f"{format_bytes(nbytes):>9}" + "".join(
            f" {cells[c]['seconds'] * 1e6:>10.1f} {cells[c]['busbw_GBps']:>6.3f}"
            if c in cells else f" {'-':>17}" for c in collectives))
    if model:
        world = rows[0]["world_size"]
        largest = max(by_size)
        print(f"the model at {format_bytes(largest)}: " + ", ".join(
            f"{c} {model.predict(largest, world, c) * 1e6:.0f} us" for c in collectives))


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)

    copy_Bps = copy_bandwidth(args.copy_bytes, args.rounds, device)
    metrics.write(event="copy", nbytes=args.copy_bytes, GBps=copy_Bps / 1e9, copying_ranks=world_size)
    rows = sweep(args, device)
    for row in rows:
        metrics.write(event="collective", **row)

    if rank == 0:
        fit_on = args.fit_collectives
        model = None
        if world_size > 1:  # one process moves no data: there is nothing to fit
            model = AlphaBeta.fit([measurement(r) for r in rows if r["collective"] in fit_on],
                                  backend=backend, world_size=world_size, device=device.type,
                                  collectives=fit_on)
            model.save(args.model_out)
        print(f"{world_size} process(es), {backend} on {device.type}; time: median of up to "
              f"{args.rounds} rounds; model: the alpha-beta fit below")
        print_table(rows, model)
        print(f"memory copy: {copy_Bps / 1e9:.2f} GB/s per process (Tensor.copy_ of "
              f"{format_bytes(args.copy_bytes)}, {world_size} process(es) copying at once)")
        if model is None:
            print("no model fitted: a world of one moves no data; run with 2 or more processes")
        else:
            errors = model.relative_errors(measurement(r) for r in rows if r["collective"] in fit_on)
            print(f"alpha-beta fit to {', '.join(fit_on)}: alpha = {model.alpha_s * 1e6:.1f} us, "
                  f"beta = 1 / ({model.bandwidth_bytes_per_s / 1e9:.3f} GB/s); median |relative "
                  f"error| {statistics.median(abs(e) for e in errors):.0%}; saved to "
                  f"{os.path.relpath(args.model_out)}")
            metrics.write(event="fit", alpha_s=model.alpha_s, beta_s_per_byte=model.beta_s_per_byte,
                          collectives=fit_on, path=str(args.model_out), relative_errors=errors)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
