"""What the notebooks show besides their printouts (no torch): several runs' loss curves on one set
of axes, and a file a run wrote offered as a download."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import matplotlib.pyplot as plt

from dtbook.paths import RUNS_DIR

# Files a page offers for download. The book's build copies this folder into the book's source
# (tools/build_book.py), so that a {download} role can name them; Sphinx then copies each one
# beside the page's HTML instead of the page carrying it inline.
DOWNLOADS_DIR = RUNS_DIR / "downloads"

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


def download_role(path: Path, name: str) -> str:
    """Gzip ``path`` to ``runs/downloads/<name>`` and return a MyST {download} role for it.

    Display the role with ``IPython.display.Markdown`` in a cell whose metadata holds
    ``{"mystnb": {"markdown_format": "myst"}}``, so that the book renders it as MyST (a link)
    rather than as plain CommonMark.
    """
    if not name.endswith(".gz"):
        raise ValueError(f"{name}: the download is gzipped, so its name ends in .gz")
    DOWNLOADS_DIR.mkdir(parents=True, exist_ok=True)
    target = DOWNLOADS_DIR / name
    with path.open("rb") as source, gzip.open(target, "wb") as packed:
        shutil.copyfileobj(source, packed)
    return f"{{download}}`{name} </runs/downloads/{name}>`"
