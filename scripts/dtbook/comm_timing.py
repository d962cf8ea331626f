"""Timing communication the same way in every benchmark: rounds of back-to-back calls, slowest rank.

A round starts on all ranks together (a barrier), makes ``calls`` calls one after the other and
ends when the slowest rank has finished them: a collective is not done until every rank is. Many
calls per round average away the few microseconds by which ranks leave the barrier apart, which
would otherwise swamp the latency of a small message. On a GPU the device is synchronised before
the clock is read, since collectives there only queue work.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], calls: int, rounds: int,
                     device: torch.device) -> list[float]:
    """Seconds per call of ``fn`` in each of ``rounds`` rounds, on the slowest
    rank."""
    per_call = []
    for _ in range(rounds):
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        per_call.append((time.perf_counter() - start) / calls)
    slowest = torch.tensor(per_call, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def calls_per_round(fn: Callable[[], object], round_seconds: float, max_calls: int,
                    device: torch.device) -> tuple[int, float]:
    """How many calls of ``fn`` fill a round of ``round_seconds``, and the seconds of one.

    One call is timed (it doubles as the warm-up that allocates buffers and connections), and
    the count is derived from the slowest rank's time, so every rank makes as many calls.
    """
    first = seconds_per_call(fn, calls=1, rounds=1, device=device)[0]
    return max(1, min(max_calls, int(round_seconds / first))), first
