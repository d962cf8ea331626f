"""Metrics as JSON lines: rank 0 writes one object per line, notebooks and tests read them back.

This module does not import torch, so the notebook side can read metrics without paying for it.
"""

from __future__ import annotations

import json
from pathlib import Path


class MetricsWriter:
    """Append one JSON object per line; a no-op on ranks other than 0 or without a path."""

    def __init__(self, path: str | Path | None, enabled: bool = True):
        self.file = None
        if path and enabled:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)

    def write(self, **record) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def run_each(demos: dict, names: list[str], metrics: MetricsWriter, event: str, rank: int) -> None:
    """Run the demonstrations named (in the order of ``demos``), each a function returning
    what it found; write each outcome as an ``event`` record and print it on rank 0."""
    for name in [n for n in demos if n in names]:
        outcome = demos[name]()
        metrics.write(event=event, name=name, **outcome)
        if rank == 0:
            print(f"{name}: {outcome}", flush=True)


def read_metrics(path: str | Path) -> list[dict]:
    """Every record of a metrics file, in order; an absent file has none."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def describe_provenance(prov: dict) -> str:
    """The one line printed under every run in the book: where its numbers came from."""
    return (
        f"ran on: {prov['backend']} · {prov['world_size']} process(es) · "
        f"{prov['device']} ({prov['device_name']}, {prov['cpu_cores']} cores) · torch {prov['torch']}"
    )
