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
(all_gather), or each rank's input (reduce_scatter). At every size, before the first
collective's call, every rank also times torch.Tensor.copy_ of S bytes into a buffer it has
already written, all at once: the memory-copy rate at that size, under the load of that
moment, which data moving between processes on one machine cannot beat. The all_reduce of
the largest message is timed once more before and once after the sweep: if the two differ,
the machine's load drifted during it. After the sweep, every rank times, in alternating
rounds, torch.Tensor.clone of the largest message (fresh memory filled with a copy, the
local work that PyTorch's gloo backend adds to reduce_scatter and all_gather: it clones the
input, or gathers into a fresh buffer and copies out) and copy_ of it into a buffer already
written, and counts the minor page faults of one call of each collective, of the list
dist.reduce_scatter and of the clone: the fresh memory each touches. Then rank 0 fits
t = a * alpha + b * S * beta (scripts/dtbook/cost_model.py) to the times of
--fit-collectives (default: all_reduce, the collective of DDP) and saves the model as
JSON (--model-out), from which later chapters predict communication times.
"""

import argparse
import os
import resource
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
from dtbook.measure import page_faults_per_call

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


def copy_call(elements: int, device: torch.device):
    """Tensor.copy_ of ``elements`` floats into a buffer already written: no fresh pages."""
    source = torch.ones(elements, device=device)
    target = torch.zeros_like(source)  # zeros_ writes every page now, before any timing
    return partial(target.copy_, source)


def copy_seconds(args, elements: int, device: torch.device) -> float:
    """Seconds per copy_ of ``elements`` floats on the slowest rank, every
    rank copying at once: timed as the collectives are (back-to-back calls,
    the median of rounds)."""
    copy = copy_call(elements, device)
    calls, _ = calls_per_round(copy, args.round_seconds, args.max_calls, device)
    return statistics.median(
        seconds_per_call(copy, calls, max(3, args.rounds), device))


def clone_and_copy_seconds(nbytes: int, rounds: int, device: torch.device) -> dict:
    """Seconds per Tensor.clone and per copy_ of ``nbytes`` on the slowest rank, every rank at
    once, in alternating rounds, so that both see the same load. A clone is new memory (its
    pages fresh) plus a copy into it; the copy alone writes into pages already mapped."""
    source = torch.ones(nbytes // FLOAT32_BYTES, device=device)
    clone = source.clone  # the result is dropped at once, as gloo's buffers are
    copy = partial(torch.zeros_like(source).copy_, source)
    times = {"clone": [], "copy": []}
    for _ in range(rounds + 1):  # the first round of each is a warm-up, not kept
        for name, fn in (("clone", clone), ("copy", copy)):
            times[name] += seconds_per_call(fn, calls=1, rounds=1, device=device)
    return {name: seconds[1:] for name, seconds in times.items()}


def reference_seconds(args, elements: int, device: torch.device) -> list[float]:
    """The rounds of one all_reduce of ``elements`` floats: a reference for the load."""
    call = collective_call("all_reduce", elements, device)
    calls, _ = calls_per_round(call, args.round_seconds, args.max_calls, device)
    return seconds_per_call(call, calls, max(3, args.rounds), device)


def sweep(args, device: torch.device) -> list[dict]:
    """Time every collective at every size: one row per (collective, size)."""
    world_size = dist.get_world_size()
    rows = []
    for index, name in enumerate(args.collectives):
        for elements in message_elements(args, world_size):
            if index == 0:  # the copy rate at this size, just before the first collective's
                copy = copy_seconds(args, elements, device)
                rows.append({"collective": "copy_", "world_size": world_size,
                             "nbytes": elements * FLOAT32_BYTES, "seconds": copy,
                             "GBps": elements * FLOAT32_BYTES / copy / 1e9})
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
    copies = {r["nbytes"]: r for r in rows if r["collective"] == "copy_"}
    rows = [r for r in rows if r["collective"] != "copy_"]
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
            if c in cells else f" {'-':>17}" for c in collectives)
              + (f"  copy_ {copies[nbytes]['GBps']:.2f} GB/s" if nbytes in copies else ""))
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

    largest = message_elements(args, world_size)[-1] * FLOAT32_BYTES
    before = reference_seconds(args, largest // FLOAT32_BYTES, device)
    swept = sweep(args, device)
    after = reference_seconds(args, largest // FLOAT32_BYTES, device)
    metrics.write(event="drift", collective="all_reduce", nbytes=largest,
                  before_round_seconds=before, after_round_seconds=after)
    for row in swept:
        if row["collective"] == "copy_":
            metrics.write(event="copy", copying_ranks=world_size, **row)
        else:
            metrics.write(event="collective", **row)
    rows = [row for row in swept if row["collective"] != "copy_"]
    timed = clone_and_copy_seconds(largest, args.rounds, device)
    metrics.write(event="clone", nbytes=largest, seconds=statistics.median(timed["clone"]),
                  round_seconds=timed["clone"], copy_round_seconds=timed["copy"])
    faults = {name: page_faults_per_call(
        collective_call(name, largest // FLOAT32_BYTES, device)) for name in args.collectives}
    if "reduce_scatter" in args.collectives:  # the list API: another path in ProcessGroupGloo
        full = torch.ones(largest // FLOAT32_BYTES, device=device)
        shard = torch.empty(largest // FLOAT32_BYTES // world_size, device=device)
        faults["reduce_scatter (list)"] = page_faults_per_call(
            partial(dist.reduce_scatter, shard, list(full.tensor_split(world_size))))
    faults["clone"] = page_faults_per_call(torch.ones(largest // FLOAT32_BYTES).clone)
    metrics.write(event="page_faults", nbytes=largest, page_bytes=resource.getpagesize(),
                  per_call=faults)

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
        print_table(swept, model)
        print(f"memory copy: copy_ of each size, {world_size} process(es) copying at once "
              f"(last column)")
        print(f"all_reduce of {format_bytes(largest)}: {statistics.median(before) * 1e3:.2f} ms "
              f"before the sweep, {statistics.median(after) * 1e3:.2f} ms after it")
        print(f"clone: {statistics.median(timed['clone']) * 1e3:.2f} ms per Tensor.clone of "
              f"{format_bytes(largest)}, copy_ {statistics.median(timed['copy']) * 1e3:.2f} ms "
              f"in alternating rounds ({world_size} process(es) at once)")
        print(f"minor page faults per call at {format_bytes(largest)} on rank 0 "
              f"({largest // resource.getpagesize()} pages): "
              + ", ".join(f"{name} {n:.0f}" for name, n in faults.items()))
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
