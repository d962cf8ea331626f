"""Plots the notebooks share: several runs' loss curves on one set of axes (no torch)."""

from __future__ import annotations

import matplotlib.pyplot as plt

# The reference run underneath, wide and grey, so that a run that follows it exactly shows as a
# thin line inside a wide one; the others in turn.
REFERENCE_STYLE = {"color": "black", "lw": 3, "alpha": 0.35}
STYLES = [{"color": "tab:blue", "lw": 1.5, "ls": "--"}, {"color": "tab:red", "lw": 1.2},
          {"color": "tab:orange", "lw": 1.5, "ls": ":"}, {"color": "tab:green", "lw": 1.2, "ls": "-."}]


def loss_curve(run) -> dict[int, float]:
    """Step -> loss from a run's ``step`` records (a launcher result); a dict is taken as it is."""
    if isinstance(run, dict):
        return run
    return {r["step"]: r["loss"] for r in run.records("step")}


def plot_loss_curves(runs: dict, title: str | None = None, marks: dict[str, float] | None = None,
                     ylabel: str = "training loss", figsize=(8, 4)) -> dict[str, dict[int, float]]:
    """Draw one loss curve per run, the first as the reference; return the curves by label.

    ``marks`` are labelled vertical lines at a step (a crash, a resume, an epoch's end).
    """
    curves = {label: loss_curve(run) for label, run in runs.items()}
    _, ax = plt.subplots(figsize=figsize)
    for index, (label, points) in enumerate(curves.items()):
        style = REFERENCE_STYLE if index == 0 else STYLES[(index - 1) % len(STYLES)]
        ax.plot(list(points), list(points.values()), label=label, **style)
    for index, (label, step) in enumerate((marks or {}).items()):
        ax.axvline(step, color=f"C{index + 4}", lw=1, ls=":", label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend()
    plt.show()
    return curves
