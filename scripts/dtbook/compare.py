"""The book's one definition of "the same training": two runs' weights, compared by scale.

Two runs that see the same data in the same order but add their gradients in another order (two
processes instead of one, a bucketed all-reduce, sharded gradients, accumulation) do not end with
equal weights: float addition is not associative, and every step feeds the rounding of the last
one into the next. They are still the same training. A run that saw one different batch is not.

The measure is the *relative L2 gap* of the two weight sets, ``||a - b|| / ||b||`` over every
tensor (the attention key biases left out, see ``dtbook.model.without_key_bias``): one number,
scaled by the weights themselves, so it means the same for a tiny and a large model, and for
float32 on any CPU. The tolerance grows with the number of optimizer steps, because rounding
differences compound step after step: ``GAP_PER_STEP * steps``. Measured on this book's runs, a
reordering of the sums leaves a gap of about 1e-6 per step (HSDP 2 x 2 after 30 steps: 1.3e-4);
one different batch in one step moves the weights by about the learning rate, a gap of 1e-2 and
more. ``GAP_PER_STEP = 1e-4`` sits between them, with room on both sides.

Every comparison that claims "the same training" shows its margin on both sides, and a control
that must fail: ``compare_training`` asserts that the runs are at least ``MARGIN`` times inside
the tolerance and the controls at least ``MARGIN`` times outside it (``compare_gaps`` does the
same for gaps that a script measured and recorded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dtbook.model import without_key_bias

GAP_PER_STEP = 1e-4
MARGIN = 10.0


def training_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` over all tensors of two state dicts, the key biases left out."""
    a, b = without_key_bias(a), without_key_bias(b)
    if a.keys() != b.keys():
        missing = sorted(a.keys() ^ b.keys())
        raise ValueError(f"the two runs have different weights: {missing[:4]}")
    difference = math.sqrt(sum(((a[k].double() - b[k].double()) ** 2).sum().item() for k in a))
    norm = math.sqrt(sum((b[k].double() ** 2).sum().item() for k in b))
    return difference / norm


def same_training_tolerance(steps: int) -> float:
    """The largest gap two runs of ``steps`` optimizer steps may have and still be the same training."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    return GAP_PER_STEP * steps


def same_training(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], steps: int) -> bool:
    """Whether two runs of ``steps`` optimizer steps ended as the same training."""
    return training_gap(a, b) <= same_training_tolerance(steps)


@dataclass(frozen=True)
class Comparison:
    """One run measured against the reference."""

    name: str
    gap: float
    tolerance: float
    control: bool  # a control must fail the tolerance

    @property
    def same(self) -> bool:
        return self.gap <= self.tolerance

    @property
    def margin(self) -> float:
        """How far inside (a run) or outside (a control) the tolerance the gap is, as a factor."""
        if self.control:
            return self.gap / self.tolerance
        return math.inf if self.gap == 0 else self.tolerance / self.gap

    def row(self) -> str:
        verdict = "same training" if self.same else "different"
        side = "outside" if self.control else "inside"
        margin = "exact" if math.isinf(self.margin) else f"{self.margin:,.0f}x {side}"
        kind = "control" if self.control else "run"
        return f"{self.name:<34} {kind:<8} {self.gap:>9.2e}  {verdict:<14} {margin}"


def compare_training(reference: dict[str, torch.Tensor], runs: dict[str, dict[str, torch.Tensor]],
                     controls: dict[str, dict[str, torch.Tensor]], steps: int,
                     margin: float = MARGIN) -> list[Comparison]:
    """Compare runs and controls with the reference, print the table, and assert the margins.

    Every run must be the same training as the reference, ``margin`` times inside the tolerance;
    every control (a run that trained differently for a reason) must be ``margin`` times outside.
    """
    return compare_gaps({name: training_gap(w, reference) for name, w in runs.items()},
                        {name: training_gap(w, reference) for name, w in controls.items()}, steps, margin)


def compare_gaps(gaps: dict[str, float], control_gaps: dict[str, float], steps: int,
                 margin: float = MARGIN) -> list[Comparison]:
    """``compare_training`` for gaps a script measured itself (``training_gap`` against its reference).

    At least one control is required: without one a loose tolerance would go unnoticed.
    """
    if not control_gaps:
        raise ValueError("a comparison needs a control: a run that must fail the tolerance")
    tolerance = same_training_tolerance(steps)
    rows = [Comparison(name, gap, tolerance, False) for name, gap in gaps.items()]
    rows += [Comparison(name, gap, tolerance, True) for name, gap in control_gaps.items()]
    print(f"the same training after {steps} steps: relative L2 gap <= {tolerance:.1e} "
          f"({GAP_PER_STEP:.0e} per step)")
    print(f"{'compared with the reference':<34} {'':<8} {'gap':>9}  {'verdict':<14} margin")
    for row in rows:
        print(row.row())
    for row in rows:
        if row.control:
            assert not row.same, f"control {row.name}: gap {row.gap:.2e} is inside the tolerance"
        else:
            assert row.same, f"{row.name}: gap {row.gap:.2e} is outside the tolerance {tolerance:.1e}"
        assert row.margin >= margin, (
            f"{row.name}: only {row.margin:.1f}x {'outside' if row.control else 'inside'} the "
            f"tolerance (at least {margin:.0f}x needed): the comparison cannot tell the claim from "
            "its control")
    return rows
