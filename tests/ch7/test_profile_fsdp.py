"""Chapter 7, section 1: the FSDP profiler names the events of a step as the timeline needs.

The notebook runs the script on the lab and asserts the counts of collectives per unit; here, in
process, the naming of trace events (whose control cases are FSDP's own record_function regions,
which carry the same words) and the one-line refusal of a trace directory that cannot be made.
"""

import pytest

from support import load_script, run_in_process


@pytest.fixture(scope="module")
def fsdp_profiler():
    return load_script("ch7_profile_fsdp.py")


@pytest.mark.parametrize("name, kind", [
    ("c10d::_allgather_base_", "all-gather launched"),
    ("c10d::_reduce_scatter_base_", "reduce-scatter launched"),
    ("gloo:all_gather", "all-gather in progress"),
    ("gloo:all_reduce", "reduce-scatter in progress"),  # gloo's way of reduce-scattering
    ("nccl:reduce_scatter", "reduce-scatter in progress"),
    ("autograd::engine::evaluate_function: MmBackward0", "gradient computation"),
    ("backward", "backward"),
    # FSDP's own regions and copies mention the collectives but are not the backend's work:
    ("FSDP::all_gather (blocks.0)", None),
    ("fsdp::all_gather_copy_in", None),
    ("FSDP::post_backward_reduce (blocks.1)", None),
])
def test_events_are_named_for_the_timeline(fsdp_profiler, name, kind):
    assert fsdp_profiler.interval_kind(name) == kind


def test_summary_counts_gathers_by_the_region_they_start_in(fsdp_profiler, tmp_path):
    def interval(kind, start, end):
        return {"kind": kind, "start_ms": start, "end_ms": end}

    intervals = [interval("forward", 0, 10), interval("backward", 10, 30),
                 interval("all-gather launched", 1, 1.1),
                 interval("all-gather launched", 9.9, 10),  # still forward
                 interval("all-gather launched", 12, 12.1),
                 interval("reduce-scatter launched", 20, 20.1),
                 interval("all-gather in progress", 12, 16),
                 interval("gradient computation", 14, 20)]
    summary = fsdp_profiler.summarize(intervals, tmp_path / "rank0.json", units=2)
    assert (summary["all_gathers_in_forward"], summary["all_gathers_in_backward"]) == (2, 1)
    assert summary["reduce_scatters"] == 1
    assert summary["communication_during_gradient_computation_ms"] == pytest.approx(2.0)


def test_a_trace_dir_that_cannot_be_made_is_one_line(monkeypatch, capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code = run_in_process("ch7_profile_fsdp.py", "--trace-dir", blocker / "traces",
                          monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: cannot create --trace-dir")
    assert len(err.splitlines()) == 1
