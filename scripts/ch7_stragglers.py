"""Find the rank that slows a data-parallel job down: per-rank step times, all-gathered.

    torchrun --standalone --nproc_per_node=3 scripts/ch7_stragglers.py
    # fault injection: from step 21 on, rank 1's forward sleeps 40 ms every step
    torchrun --standalone --nproc_per_node=3 scripts/ch7_stragglers.py \\
        --slow-rank 1 --slow-ms 40 --slow-from-step 21

Trains the book's GPT with DDP (ch3_train.py's model, data and AdamW) and times
every step on every rank, in three parts:

  compute  from the start of the step until backward has computed its last
           gradient: this rank's own work (forward and backward)
  waited   from there until backward returns, the gradients averaged: the
           all-reduce, and the wait for every other rank's gradients
  total    the whole step, optimizer included

Every --every steps the ranks all-gather their times, and rank 0 flags a rank
whose median compute time over those steps is more than --factor times the
median of the other ranks' medians; flagged in --confirm checks in a row, it is
named a straggler. One line per check shows each rank's medians.

The total cannot find it. DDP's all-reduce finishes on every rank at once, when
the slowest rank's gradients arrive, so every rank's step lasts as long as the
slowest one's: one slow rank slows everybody, and all totals stay alike. The
straggler shows in its own compute time, and in the others' waiting: it waits
least, since everyone else is ready when it arrives.

--slow-rank R --slow-ms M is a fault injection: rank R sleeps M ms at the start
of every forward, as a GPU that throttles, a noisy neighbour or a slow data
pipeline would delay it; with --slow-from-step S only from step S on, so that
the checks before S are the same job without the fault, a control. The times
are the host's clock; on a GPU, record CUDA events instead (kernels run
asynchronously).
"""

import argparse
import os
import statistics
import time

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
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES
from dtbook.timing import LastGradientClock

PARTS = ("compute", "waited", "total")


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_SIZES), default="tiny", help="model size (default: tiny)")
    add("--batch-size", type=positive_int, default=8, help="windows per process per step (default 8)")
    add("--steps", type=positive_int, default=40, help="optimizer steps (default 40)")
    add("--every", type=positive_int, default=10,
        help="all-gather the step times and look for a straggler every N steps (default 10)")
    add("--factor", type=positive_float, default=2.0,
        help="a straggler's median compute time exceeds the others' by this factor (default 2)")
    add("--confirm", type=positive_int, default=2,
        help="name a straggler once it is flagged in this many checks in a row (default 2)")
    add("--slow-rank", type=int, help="fault injection: this rank's forward is delayed")
    add("--slow-ms", type=positive_float,
        help="the delay of --slow-rank's forward, in ms (default 40)")
    add("--slow-from-step", type=positive_int, default=1,
        help="the first step --slow-rank is delayed (default 1: every step)")
    add("--seed", type=int, default=DEFAULTS.seed, help="seeds the weights and the data")
    add_backend_and_metrics(parser)
    args = parser.parse_args()
    if args.slow_rank is None and (args.slow_ms is not None or args.slow_from_step != 1):
        parser.error("--slow-ms and --slow-from-step delay the forward of --slow-rank: "
                     "give --slow-rank too")
    if args.slow_rank is not None and args.slow_ms is None:
        args.slow_ms = 40.0
    return args


def check_inputs(args: argparse.Namespace, world: int) -> None:
    """What can be refused before the process group exists, in one line."""
    if args.slow_rank is not None and not 0 <= args.slow_rank < world:
        raise ScriptError(f"--slow-rank {args.slow_rank} is not a rank of this world of "
                          f"{world} process(es) (ranks 0 to {world - 1})")
    if world < 2:
        raise ScriptError("a straggler is one rank among others: run 2 or more processes "
                          "(torchrun --nproc_per_node=3)")
    if args.factor <= 1:
        raise ScriptError(f"--factor {args.factor} would flag ranks no slower than the "
                          "others: give a factor above 1")
    if args.every < 3 or args.every > args.steps:
        raise ScriptError(f"--every {args.every}: a check needs 3 or more steps, and "
                          f"--steps {args.steps} must hold at least one check")
    if args.confirm > args.steps // args.every:
        raise ScriptError(f"--confirm {args.confirm} needs that many checks, but --steps "
                          f"{args.steps} makes {args.steps // args.every} of --every "
                          f"{args.every}")
    if args.slow_from_step > args.steps:
        raise ScriptError(f"--slow-from-step {args.slow_from_step} is after the last "
                          f"step, {args.steps}: nothing would be delayed")


def inject_delay(model: torch.nn.Module, ms: float, from_call: int) -> None:
    """Fault injection: from its ``from_call``-th call on, every forward of ``model``
    starts ``ms`` later."""
    calls = 0

    def sleep(module, inputs) -> None:
        nonlocal calls
        calls += 1
        if calls >= from_call:
            time.sleep(ms / 1000)

    model.register_forward_pre_hook(sleep)


def timed_step(model, optimizer, batch, clock: LastGradientClock) -> tuple:
    """One DDP step: its (compute, waited, total) milliseconds on this rank."""
    x, y = batch
    start = time.perf_counter()
    model(x, y).backward()  # returns once DDP's last bucket is averaged
    averaged = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad()
    end = time.perf_counter()
    compute, waited = clock.at - start, averaged - clock.at
    return compute * 1000, waited * 1000, (end - start) * 1000


def gather_step_times(window: list[tuple[float, ...]], device) -> torch.Tensor:
    """Collective: every rank's step times of the window, [rank, step, part]."""
    mine = torch.tensor(window, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone).cpu()


def find_stragglers(ms_per_rank: list[list[float]], factor: float) -> list[int]:
    """Ranks whose median is over ``factor`` x the others' median of medians."""
    medians = [statistics.median(ms) for ms in ms_per_rank]
    flagged = []
    for rank, median in enumerate(medians):
        others = statistics.median(medians[:rank] + medians[rank + 1:])
        if median > factor * others:
            flagged.append(rank)
    return flagged


class StragglerWatch:
    """Rank 0's verdicts. Each check applies the rule to its window; a rank is named a
    straggler once the rule has flagged it in ``confirm`` checks in a row, since one
    window can be unlucky (a process descheduled for a while). The same rule on the total
    step times runs beside it, as a control that must find nobody."""

    def __init__(self, world: int, factor: float, confirm: int):
        self.factor, self.confirm = factor, confirm
        self.in_a_row = [0] * world
        self.named_at: dict[int, int] = {}  # rank -> the check that named it
        self.checks = 0

    def check(self, times: torch.Tensor, first_step: int) -> dict:
        self.checks += 1
        per_part = {part: times[:, :, i].tolist() for i, part in enumerate(PARTS)}
        medians = {part: [statistics.median(ms) for ms in per_rank]
                   for part, per_rank in per_part.items()}
        flagged = find_stragglers(per_part["compute"], self.factor)
        self.in_a_row = [n + 1 if r in flagged else 0 for r, n in enumerate(self.in_a_row)]
        stragglers = [r for r, n in enumerate(self.in_a_row) if n >= self.confirm]
        for rank in stragglers:
            self.named_at.setdefault(rank, self.checks)
        by_total = find_stragglers(per_part["total"], self.factor)
        last_step = first_step + times.shape[1] - 1
        columns = "".join(" ".join(f"{ms:4.0f}" for ms in medians[part]) + " | "
                          for part in PARTS)
        print(f"{f'{first_step}-{last_step}':>7} | {columns}{ranks(flagged):^7} | "
              f"{ranks(stragglers):^9} | {ranks(by_total):^8}".rstrip(), flush=True)
        return {"check": self.checks, "first_step": first_step, "last_step": last_step,
                "flagged": flagged, "stragglers": stragglers, "flagged_by_total": by_total,
                **{f"{part}_ms": per_part[part] for part in PARTS},
                **{f"median_{part}_ms": medians[part] for part in PARTS}}

    def header(self) -> str:
        width = 5 * len(self.in_a_row) - 1
        return (f"{'steps':>7} | " + "".join(f"{part:^{width}} | " for part in PARTS)
                + "flagged | straggler | by total")

    def summary(self) -> str:
        named = ", ".join(f"rank {r} (at check {c})" for r, c in sorted(self.named_at.items()))
        return (f"{self.checks} checks; straggler ({self.confirm} flagged checks in a row): "
                f"{named or 'none'}")


def ranks(flagged: list[int]) -> str:
    return ",".join(map(str, flagged)) or "-"


def main() -> None:
    args = parse_args()
    check_inputs(args, int(os.environ.get("WORLD_SIZE", 1)))
    backend, device = start_process_group(args.backend, timeout_s=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    dataset = corpus_windows(DEFAULTS.corpus_tokens, cfg.vocab_size, cfg.context, args.seed)
    batches = first_batches(dataset, args.batch_size, rank, world, args.seed, args.steps,
                            device)
    torch.manual_seed(args.seed)
    model = DDP(GPT(cfg).to(device), device_ids=ddp_device_ids(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEFAULTS.lr)
    clock = LastGradientClock(model.module)
    if rank == args.slow_rank:
        inject_delay(model.module, args.slow_ms, args.slow_from_step)
    metrics.write(event="config", model=args.model, world_size=world, steps=args.steps,
                  every=args.every, factor=args.factor, slow_rank=args.slow_rank,
                  slow_ms=args.slow_ms, slow_from_step=args.slow_from_step)
    if rank == 0:
        print(f"{args.model} model, {world} processes, {backend}; medians in ms, ranks "
              f"0..{world - 1}; flagged: compute > {args.factor:g}x the others'")

    watch = StragglerWatch(world, args.factor, args.confirm)
    if rank == 0:
        print(watch.header())
    window = []
    for step, batch in enumerate(batches, start=1):
        window.append(timed_step(model, optimizer, batch, clock))
        if step % args.every == 0:
            times = gather_step_times(window, device)
            if rank == 0:
                metrics.write(event="check", **watch.check(times, step - len(window) + 1))
            window = []
    if rank == 0:
        print(watch.summary())
        metrics.write(event="summary", checks=watch.checks,
                      named_at={str(r): c for r, c in watch.named_at.items()})
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
