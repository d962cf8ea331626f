"""Intervals from a profiler trace: read them, merge them, measure how long they overlap.

torch.profiler exports a Chrome trace, JSON whose "traceEvents" include complete events
("ph": "X"), each with a name, a thread ("tid"), a start ("ts") and a duration ("dur") in
microseconds. A profiling script names the events it wants with ``kind_of`` and gets them
back as intervals in milliseconds from the start of the step's "forward" region. No torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def read_intervals(trace_path: Path, kind_of: Callable[[str], str | None]) -> list[dict]:
    """The events ``kind_of`` gives a kind (None: left out), in ms from the step's start."""
    events = [e for e in json.loads(Path(trace_path).read_text())["traceEvents"]
              if e.get("ph") == "X"]
    step_start = min(e["ts"] for e in events if e["name"] == "forward")
    intervals = []
    for e in events:
        kind = kind_of(e["name"])
        if kind is None:
            continue
        start = (e["ts"] - step_start) / 1000
        intervals.append({"kind": kind, "name": e["name"], "thread": str(e["tid"]),
                          "start_ms": start, "end_ms": start + e["dur"] / 1000})
    return intervals


def merged(intervals: list[dict]) -> list[list[float]]:
    """The same time covered by disjoint [start, end] spans."""
    spans = []
    for i in sorted(intervals, key=lambda i: i["start_ms"]):
        if spans and i["start_ms"] <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], i["end_ms"])
        else:
            spans.append([i["start_ms"], i["end_ms"]])
    return spans


def busy_ms(intervals: list[dict]) -> float:
    """How long at least one of ``intervals`` runs."""
    return sum(end - start for start, end in merged(intervals))


def overlap_ms(a: list[dict], b: list[dict]) -> float:
    """How long something from ``a`` and something from ``b`` run at the same time."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2))
               for s1, e1 in merged(a) for s2, e2 in merged(b))
