"""The exposed fraction: how much of its communication a data-parallel step pays for.

The book's one definition, used by every script and page that shows the figure:

    exposed = waited / T_comm

``waited`` is, per step, the time from backward's last gradient (a post-accumulate-grad hook,
``timing.LastGradientClock``) until the averaged gradients are there: the communication that
no computation hid, measured inside the step. ``T_comm`` is, per step, the same all-reduces
timed with nothing else running. 0: backward hides all of it; 1: all of it comes after
backward. Both terms are measured directly, so the figure's uncertainty is theirs alone: the
spreads of T_ddp or T_local (the terms of the older first look, (T_ddp - T_local) / T_comm)
say nothing about it. No torch: scripts and notebooks call the same function.

The two terms are reduced over ranks differently, on purpose, and both choices push the
fraction low rather than high. ``waited`` is the smallest wait on any rank: the rank that
finished backward last waits only for the network, the others also wait for it (imbalance,
not communication). ``T_comm`` is the slowest rank's, like every step time in the book
(``timing.time_in_turns``), so it also holds the skew of leaving the barrier. A loop that
all-reduces after backward goes through the same two reductions, which is why the pages
compare DDP's interval with that loop's, not with a number.

On CUDA the host clock does not see the wait: with NCCL, ``backward()`` returns once the
all-reduces are enqueued and the hook fires when the accumulation is enqueued, so the
scripts pass ``host_timed=False`` there and the function refuses.
"""

from __future__ import annotations

import random
import statistics
from operator import itemgetter

# The rules and their reasons:
# below MIN_SAMPLES paired steps a bootstrap resamples too few distinct values for its
# percentiles to mean anything (with 8 steps the 2.5th percentile of 2000 resamples already
# repeats the smallest values);
MIN_SAMPLES = 8
# the host clock does not see the wait on CUDA (the module's docstring);
NOT_HOST_TIMED = ("on CUDA backward() returns before NCCL's all-reduces finish: the host "
                  "clock does not time the wait")
# the interval is the 95% percentile bootstrap of the ratio of medians, over step indices
# (waited and T_comm of one step were timed in the same turn, under the same load);
RESAMPLES, LEVEL, SEED = 2000, 0.95, 0
# T_comm is resolved when its own 95% interval stays above half its median: a denominator
# that may be less than half of what was printed (two modes on shared cores, a few stalled
# steps) would move the quotient by more than a factor of two;
COMM_FLOOR = 0.5
# an interval wider than half the scale from 0 (all hidden) to 1 (all exposed) cannot say
# whether most of the communication is hidden or most is exposed, so it says nothing.
WIDEST_INTERVAL = 0.5


def spread(ms: list[float]) -> dict:
    """The median of step times and their quartiles: a timing is printed with its spread.

    The quartiles describe how single steps scatter, not how well the median is known; with
    fewer than four samples they are no more than the extremes (the fraction refuses below
    ``MIN_SAMPLES``, so no interval is ever drawn from them).
    """
    # 'inclusive': quartiles inside the samples; the default 'exclusive' extrapolates past the
    # extremes for a few samples (a negative quartile of two positive times).
    p25, _, p75 = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else ms * 3
    return {"median": statistics.median(ms), "p25": p25, "p75": p75}


def bootstrap(waited_ms: list[float], comm_ms: list[float]) -> dict:
    """95% intervals of median(T_comm) and of median(waited) / median(T_comm).

    Resamples step indices with replacement (fixed seed: the same samples give the same
    interval), keeping each step's two terms together.
    """
    n = len(comm_ms)
    rng = random.Random(SEED)
    indices, half = range(n), n // 2
    comms, ratios = [], []
    for _ in range(RESAMPLES):
        pick = itemgetter(*rng.choices(indices, k=n))
        c, w = sorted(pick(comm_ms)), sorted(pick(waited_ms))
        if n % 2:
            comm, wait = c[half], w[half]
        else:
            comm, wait = (c[half - 1] + c[half]) / 2, (w[half - 1] + w[half]) / 2
        comms.append(comm)
        ratios.append(wait / comm)
    comms.sort()
    ratios.sort()
    lo, hi = int(RESAMPLES * (1 - LEVEL) / 2), int(RESAMPLES * (1 + LEVEL) / 2) - 1
    return {"comm": (comms[lo], comms[hi]), "ratio": (ratios[lo], ratios[hi])}


def exposed_fraction(waited_ms: list[float], comm_ms: list[float], world_size: int,
                     host_timed: bool = True) -> dict:
    """waited / T_comm from paired samples, with a 95% interval, or why not.

    Returns ``fraction`` (median waited / median T_comm), ``low`` and ``high`` (the
    bootstrap's 95% interval of that ratio, ``bootstrap``), ``waited`` and ``comm``
    (each term's median and quartiles, a description of the steps), ``n`` and
    ``reason``: None for a fraction, else why ``fraction``, ``low`` and ``high`` are
    None. The refusals, in order:

    (a) a world of one: nothing is communicated, and one process's "wait" is DDP's
        own bookkeeping, so a ratio would measure no communication;
    (b) the host clock does not see the wait (CUDA: see the module's docstring);
    (c) fewer than ``MIN_SAMPLES`` steps: too few for a bootstrap;
    (d) T_comm not resolved: its own 95% interval reaches below ``COMM_FLOOR`` times
        its median (unstable on shared cores), so the denominator is not known to a
        factor of 2;
    (e) an interval wider than ``WIDEST_INTERVAL``: it cannot tell mostly hidden from
        mostly exposed.

    ``waited`` need not stand out of zero: a wait of nothing is what overlap
    aims for.
    """
    if len(waited_ms) != len(comm_ms):
        raise ValueError(f"{len(waited_ms)} waits for {len(comm_ms)} T_comm steps: "
                         "the samples must be paired by step")
    waited, comm = spread(waited_ms), spread(comm_ms)
    result = {"waited": waited, "comm": comm, "n": len(comm_ms), "fraction": None,
              "low": None, "high": None, "reason": None}
    if world_size == 1:
        result["reason"] = "one process: nothing is communicated"
        return result
    if not host_timed:
        result["reason"] = NOT_HOST_TIMED
        return result
    if len(comm_ms) < MIN_SAMPLES:
        result["reason"] = (f"{len(comm_ms)} steps, fewer than {MIN_SAMPLES} "
                            "for a bootstrap")
        return result
    boot = bootstrap(waited_ms, comm_ms)
    comm_low, comm_high = boot["comm"]
    if comm_low < COMM_FLOOR * comm["median"]:
        result["reason"] = (f"T_comm unstable: median {comm['median']:.2g} ms, "
                            f"95% interval {comm_low:.2g}-{comm_high:.2g} "
                            "reaches below half of it")
        return result
    low, high = boot["ratio"]
    if high - low > WIDEST_INTERVAL:
        result["reason"] = (f"95% interval {low:.2f}-{high:.2f} wider than "
                            f"{WIDEST_INTERVAL:g}: cannot tell mostly hidden "
                            "from mostly exposed")
        return result
    result.update(fraction=waited["median"] / comm["median"], low=low, high=high)
    return result


def reference_ratio(waited_ms: list[float], comm_ms: list[float],
                    host_timed: bool = True) -> dict:
    """median(waited) / median(T_comm) with its 95% bootstrap interval, for a loop whose
    communication is not the T_comm it is divided by (chapter 7's naive loop, one message per
    tensor): a reference without overlap, not an exposed fraction. No width refusal: the
    ratio is not a share of its own communication and lies on no 0-to-1 scale. Fewer than
    ``MIN_SAMPLES`` steps still give no interval (``low`` and ``high`` None); where the host
    clock does not see the wait (CUDA), no ratio either, and ``reason`` says why."""
    if not host_timed:
        return {"ratio": None, "low": None, "high": None, "reason": NOT_HOST_TIMED}
    ratio = statistics.median(waited_ms) / statistics.median(comm_ms)
    if len(comm_ms) < MIN_SAMPLES:
        return {"ratio": ratio, "low": None, "high": None, "reason": None}
    low, high = bootstrap(waited_ms, comm_ms)["ratio"]
    return {"ratio": ratio, "low": low, "high": high, "reason": None}


def first_look(ddp: dict, local: dict, comm: dict) -> dict:
    """(T_ddp - T_local) / T_comm from three spreads: the subtraction, not the exposed fraction.

    Shown only beside ``exposed_fraction``, on the same run: the difference of two step
    times also holds DDP's bookkeeping and the CPU gloo's threads take from backward, and
    its interval (the quartiles' worst cases) carries the spreads of all three terms.
    """
    # Interval arithmetic: the difference's worst cases over T_comm's quartiles. A negative
    # difference is smallest over the smaller T_comm, so both ends of T_comm are tried.
    lowest, highest = ddp["p25"] - local["p75"], ddp["p75"] - local["p25"]
    return {"fraction": (ddp["median"] - local["median"]) / comm["median"],
            "low": min(lowest / comm["p25"], lowest / comm["p75"]),
            "high": max(highest / comm["p25"], highest / comm["p75"])}


def describe(result: dict) -> str:
    """'0.79 (95% 0.74-0.83)', or '- (the reason)'; a first look's '0.87 (0.30-1.75)'
    carries its quartiles' worst cases, not a 95% interval, and says no '95%'."""
    if result.get("reason") is not None:
        return f"- ({result['reason']})"
    level = "95% " if "n" in result else ""
    return f"{result['fraction']:.2f} ({level}{result['low']:.2f}-{result['high']:.2f})"


def short(result: dict) -> str:
    """'0.79 (0.74-0.83)', or '-' where there is no fraction: for a table's cell."""
    if result.get("reason") is not None:
        return "-"
    return f"{result['fraction']:.2f} ({result['low']:.2f}-{result['high']:.2f})"
