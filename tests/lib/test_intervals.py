"""dtbook.intervals: a profiler trace's events as intervals, merged, and their overlap."""

import json

import pytest

from dtbook.intervals import busy_ms, merged, overlap_ms, read_intervals


def spans(*pairs):
    return [{"start_ms": s, "end_ms": e} for s, e in pairs]


def test_merged_joins_touching_and_overlapping_spans_only():
    assert merged(spans((5, 6), (0, 2), (1, 3), (3, 4))) == [[0, 4], [5, 6]]


def test_busy_time_counts_shared_time_once():
    assert busy_ms(spans((0, 2), (1, 3), (10, 11))) == pytest.approx(4.0, abs=1e-12)


def test_overlap_is_the_time_both_sets_run():
    a = spans((0, 4), (2, 6))  # busy 0..6
    b = spans((5, 8), (1, 2))
    assert overlap_ms(a, b) == pytest.approx(2.0, abs=1e-12)
    assert overlap_ms(a, spans((6, 9))) == 0.0  # touching is not running together


def test_read_intervals_keeps_named_complete_events_from_the_step_start(tmp_path):
    events = [{"ph": "X", "name": "forward", "ts": 1000, "dur": 2000, "tid": 1},
              {"ph": "X", "name": "gloo:all_reduce", "ts": 2500, "dur": 500, "tid": 7},
              {"ph": "X", "name": "aten::mm", "ts": 1200, "dur": 100, "tid": 1},
              {"ph": "i", "name": "gloo:all_reduce", "ts": 0, "tid": 7}]  # not complete
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    kinds = {"forward": "forward", "gloo:all_reduce": "collective"}
    intervals = read_intervals(trace, kinds.get)
    assert [(i["kind"], i["thread"]) for i in intervals] == [("forward", "1"), ("collective", "7")]
    assert [(i["start_ms"], i["end_ms"]) for i in intervals] == [(0.0, 2.0), (1.5, 2.0)]
