"""Timing distributed steps fairly: a common start, the slowest rank's end, configurations in turn.

A synchronized training step lasts until its slowest rank is done, so that is what is measured.
On a shared machine the background load changes from one second to the next; calling the
configurations under comparison in turn, step by step, exposes them all to the same load.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from dtbook.exposed import spread  # noqa: F401  (re-exported: a timing with its spread)


def time_in_turns(functions: dict[str, Callable[[], object]], steps: int, warmup: int,
                  device: torch.device) -> dict[str, list[float]]:
    """Milliseconds of each call of each function, as the slowest rank saw it.

    Collective: every rank calls the functions in the same order, ``warmup`` untimed rounds
    and then ``steps`` timed ones. Each call starts after a barrier.
    """
    for _ in range(warmup):
        for fn in functions.values():
            fn()
    times = {name: [] for name in functions}
    for _ in range(steps):
        for name, fn in functions.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - start) * 1000)
    slowest = {}
    for name, ms in times.items():
        per_call = torch.tensor(ms, device=device)
        dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
        slowest[name] = per_call.tolist()
    return slowest


class LastGradientClock:
    """Notes when backward computed its last gradient: a hook on every parameter."""

    def __init__(self, module: torch.nn.Module):
        self.at = 0.0
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self.tick)

    def tick(self, param) -> None:
        self.at = time.perf_counter()


def waited_ms(waits: list[float], warmup: int, device: torch.device) -> list[float]:
    """Per timed step, the smallest wait on any rank, in ms (collective).

    ``waits`` holds, per step, the seconds from backward's last gradient until the
    gradients were averaged. The rank that finished backward last waits only for the
    network; the others also wait for it, which is imbalance between ranks, not
    communication.
    """
    timed = torch.tensor(waits[warmup:], device=device) * 1000
    dist.all_reduce(timed, op=dist.ReduceOp.MIN)
    return timed.tolist()
