"""The alpha-beta (latency-bandwidth) model of a collective's time: fit it, save it, predict with it.

A collective that moves n bytes among N processes is modelled as

    t = a * alpha + b * n * beta

alpha (seconds) is the fixed cost of one step of the algorithm (software overhead plus network
latency), beta (seconds per byte) the cost of moving one byte, so 1/beta is a bandwidth. a counts
the algorithm's steps and b the fraction of n that each process sends, here for the ring (and, for
broadcast, pipelined-chain) algorithms whose bus bandwidth nccl-tests reports:

    collective       a          b           n is
    all_reduce       2(N-1)     2(N-1)/N    the tensor every rank holds
    all_gather       N-1        (N-1)/N     the gathered output (N times each rank's input)
    reduce_scatter   N-1        (N-1)/N     each rank's input (N times its output)
    broadcast        N-1        1           the tensor

b is nccl-tests' bus-bandwidth factor: busbw = b * n / t, which tends to 1/beta for large n.
Chapter 2 fits alpha and beta to measured times and saves them as JSON; later chapters load the
file to predict what a training step's communication costs. Chapter 7 builds a DDP step on it
(``ddp_step_seconds``): measured compute phases plus the buckets' all-reduces, overlapped with
backward as the model of ``bucket_schedule`` says. No torch here: reading and using the
model needs none.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dtbook.paths import RUNS_DIR

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
FORMAT = "dtbook.alpha_beta/1"
MODEL_FILE = RUNS_DIR / "ch2_alpha_beta.json"  # where scripts/ch2_bandwidth.py saves the fit by default


def ring_coefficients(collective: str, world_size: int) -> tuple[float, float]:
    """(a, b) of t = a*alpha + b*n*beta for ``collective`` on ``world_size`` processes."""
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    coefficients = {
        "all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
        "all_gather": (n - 1, (n - 1) / n),
        "reduce_scatter": (n - 1, (n - 1) / n),
        "broadcast": (n - 1, 1.0 if n > 1 else 0.0),
    }
    if collective not in coefficients:
        raise ValueError(f"unknown collective {collective!r}: choose one of {', '.join(COLLECTIVES)}")
    return coefficients[collective]


def bus_bandwidth(collective: str, world_size: int, nbytes: float, seconds: float) -> float:
    """nccl-tests' bus bandwidth in bytes per second: algorithm bandwidth n/t times the factor b."""
    return ring_coefficients(collective, world_size)[1] * nbytes / seconds


@dataclass(frozen=True)
class Measurement:
    """One timed collective: ``nbytes`` as in the table above, ``seconds`` per call."""

    collective: str
    world_size: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted alpha-beta model; ``fitted_on`` records where its measurements came from."""

    alpha_s: float
    beta_s_per_byte: float
    fitted_on: dict = field(default_factory=dict)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return math.inf if self.beta_s_per_byte == 0 else 1 / self.beta_s_per_byte

    def predict(self, nbytes: float, world_size: int, collective: str = "all_reduce") -> float:
        """Predicted seconds for one call of ``collective`` over ``nbytes`` on ``world_size`` processes."""
        a, b = ring_coefficients(collective, world_size)
        return a * self.alpha_s + b * nbytes * self.beta_s_per_byte

    def relative_errors(self, measurements: Iterable[Measurement]) -> list[float]:
        """(predicted - measured) / measured for each measurement."""
        return [self.predict(m.nbytes, m.world_size, m.collective) / m.seconds - 1 for m in measurements]

    @classmethod
    def fit(cls, measurements: Iterable[Measurement], **fitted_on) -> AlphaBeta:
        """Least squares on the relative error, with alpha and beta kept
        non-negative.

        Times span decades from a few bytes to hundreds of MiB; least squares on
        seconds would fit the largest messages only and leave alpha to chance.
        Minimising sum((predicted / measured - 1)^2) weighs every size alike. The
        model is linear in alpha and beta, so this is a 2x2 linear system; if its
        solution has a negative parameter, the best non-negative fit lies on the
        boundary where that one is 0.
        """
        rows = []
        for m in measurements:
            a, b = ring_coefficients(m.collective, m.world_size)
            if m.seconds <= 0:
                raise ValueError(f"a time must be positive, got {m.seconds} s ({m})")
            rows.append((a / m.seconds, b * m.nbytes / m.seconds))
        suu = sum(u * u for u, _ in rows)
        suv = sum(u * v for u, v in rows)
        svv = sum(v * v for _, v in rows)
        su, sv = sum(u for u, _ in rows), sum(v for _, v in rows)
        det = suu * svv - suv * suv
        if not rows or suu == 0 or svv == 0 or det <= 1e-12 * suu * svv:
            raise ValueError("cannot fit alpha and beta: need measurements on 2 or "
                             "more processes at both small and large sizes")

        def cost(alpha: float, beta: float) -> float:
            return sum((u * alpha + v * beta - 1) ** 2 for u, v in rows)

        alpha, beta = (su * svv - sv * suv) / det, (sv * suu - su * suv) / det
        if alpha < 0 or beta < 0:
            alpha, beta = min([(0.0, sv / svv), (su / suu, 0.0)],
                              key=lambda ab: cost(*ab))
        return cls(alpha, beta, dict(fitted_on))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"format": FORMAT, **asdict(self), "bandwidth_GBps": self.bandwidth_bytes_per_s / 1e9}
        path.write_text(json.dumps(record, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> AlphaBeta:
        record = json.loads(Path(path).read_text())
        if record.get("format") != FORMAT:
            raise ValueError(f"{path} is not an alpha-beta model file (format {record.get('format')!r}, "
                             f"expected {FORMAT!r})")
        return cls(float(record["alpha_s"]), float(record["beta_s_per_byte"]), record.get("fitted_on", {}))


# ---------------------------------------------------------------- a training step

def bucket_schedule(backward_s: float, bucket_bytes: list[int], world_size: int,
                    link: AlphaBeta) -> list[tuple[float, float, float]]:
    """(ready, start, end) of each bucket's all-reduce, in s since backward began.

    Two assumptions make the model: backward computes gradients at a steady rate in
    bytes, so bucket k is ready once the share of backward that its and the earlier
    buckets' bytes make up has run; and the link carries one all-reduce at a time, in
    bucket order, each taking what ``link`` predicts for its size.
    """
    total = sum(bucket_bytes)
    if total <= 0:
        raise ValueError("bucket_bytes must hold at least one byte")
    schedule, done_bytes, link_free = [], 0, 0.0
    for nbytes in bucket_bytes:
        done_bytes += nbytes
        ready = backward_s * done_bytes / total
        start = max(ready, link_free)
        link_free = start + link.predict(nbytes, world_size)
        schedule.append((ready, start, link_free))
    return schedule


def ddp_step_seconds(forward_s: float, backward_s: float, optimizer_s: float,
                     bucket_bytes: list[int], world_size: int,
                     link: AlphaBeta) -> float:
    """A DDP step: forward, backward overlapped with the buckets' all-reduces,
    optimizer.

    The optimizer waits for whichever ends last, backward or the last all-reduce.
    """
    last_end = bucket_schedule(backward_s, bucket_bytes, world_size, link)[-1][2]
    return forward_s + max(backward_s, last_end) + optimizer_s


def naive_step_seconds(forward_s: float, backward_s: float, optimizer_s: float,
                       tensor_bytes: list[int], world_size: int,
                       link: AlphaBeta) -> float:
    """A loop that all-reduces each gradient tensor, one at a time, after backward."""
    communication = sum(link.predict(n, world_size) for n in tensor_bytes)
    return forward_s + backward_s + communication + optimizer_s


# ---------------------------------------------------------- model-parallel steps

def tensor_parallel_step_seconds(one_process_s: float, message_bytes: list[int],
                                 world_size: int, link: AlphaBeta,
                                 split: float = 1.0) -> float:
    """A tensor-parallel step: each rank's share of one process's compute, then every
    all-reduce.

    ``split`` is the fraction of the compute that is cut over the ranks; the rest
    (embeddings, LayerNorms, the head) every rank repeats. Nothing overlaps: each
    all-reduce sits between two layers that need its result.
    """
    if not 0 <= split <= 1:
        raise ValueError(f"split is a fraction of the compute, got {split}")
    compute = one_process_s * (1 - split + split / world_size)
    return compute + sum(link.predict(n, world_size) for n in message_bytes)


def gpipe_step_seconds(forward_s: float, backward_s: float, microbatches: int,
                       stages: int, message_bytes: int, link: AlphaBeta) -> float:
    """A GPipe step: ``forward_s`` and ``backward_s`` per micro-batch and stage.

    m + p - 1 forward and as many backward slots fill and drain the pipeline, and
    a stage sends each micro-batch's ``message_bytes`` (activations forward, their
    gradient back) before it computes the next: m + p - 2 sends each way lie on the
    critical path, each one message over the link (t = alpha + n beta).
    """
    if microbatches < 1 or stages < 1:
        raise ValueError(f"need at least one micro-batch and one stage, got "
                         f"{microbatches} and {stages}")
    slots = microbatches + stages - 1
    send = link.predict(message_bytes, 2, "broadcast") if stages > 1 else 0.0
    return slots * (forward_s + backward_s) + 2 * (slots - 1) * send
