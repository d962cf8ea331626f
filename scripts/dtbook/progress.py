"""Loss and throughput of a training loop, every N steps, on rank 0's console and in the metrics.

Every rank trains on its own slice of the global batch, so the logged loss is the mean over ranks
(one all-reduce per logged step, which is why it is logged every N steps and not every step).
Time spent writing checkpoints is excluded from the throughput and from the training time.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dtbook.metrics import MetricsWriter


class Progress:
    """Call ``step_done`` after every optimizer step; it logs every ``log_every`` steps and at the end,
    and prints every ``print_every`` logged steps (default: each one) so long runs fit on a screen."""

    def __init__(self, log_every: int, total_steps: int, global_batch: int, metrics: MetricsWriter,
                 print_every: int | None = None):
        self.log_every, self.total_steps, self.global_batch = log_every, total_steps, global_batch
        self.print_every = print_every or log_every
        self.metrics = metrics
        self.losses: list[float] = []
        self.steps_this_run = self.steps_since_log = 0
        self.start = self.last_log = time.perf_counter()
        self.excluded_s = 0.0

    def step_done(self, step: int, epoch: int, step_loss: torch.Tensor, **extra) -> None:
        """``step_loss`` is this rank's loss; ``extra`` fields go into the step record as they are."""
        self.steps_this_run += 1
        self.steps_since_log += 1
        if step % self.log_every and step != self.total_steps:
            return
        # Every rank saw a different slice of the batch: the mean over ranks is the global batch's loss.
        dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)
        self.losses.append(step_loss.item() / dist.get_world_size())
        step_time = (time.perf_counter() - self.last_log) / self.steps_since_log
        record = {"step": step, "epoch": epoch, "loss": self.losses[-1], "step_time_s": step_time,
                  "samples_per_s": self.global_batch / step_time, **extra}
        self.metrics.write(event="step", **record)
        printing = step % self.print_every == 0 or step == self.total_steps
        if printing and dist.get_rank() == 0:
            print(f"step {step:>5}/{self.total_steps} | epoch {epoch} | loss {self.losses[-1]:.4f} | "
                  f"{record['samples_per_s']:,.0f} samples/s", flush=True)
        self.last_log, self.steps_since_log = time.perf_counter(), 0

    def exclude_since(self, started: float) -> float:
        """Time since ``started`` (writing a checkpoint) counts in neither samples/s nor training time."""
        seconds = time.perf_counter() - started
        self.last_log += seconds
        self.excluded_s += seconds
        return seconds

    def train_seconds(self) -> float:
        return time.perf_counter() - self.start - self.excluded_s
