"""What scripts/ch8_tensor_parallel.py --sequence-parallel promises that section 8.6 does not run.

The notebook launches the script on 2 and 4 processes (batch 8, the small model) and asserts,
each against tensor parallelism alone or a control that must fail: logits and gradients equal
to one process, the collectives and bytes of a step against the formulas, the LayerNorms' saved
activations exactly 1/N. Here: windows that do not cut into N equal parts refused in one line;
a batch of one, where the slice of a rank's tokens is a contiguous view of the whole sequence
(only a copy keeps the saving); a world of one, where the collectives are called but move
nothing and even the control agrees; dtbook.measure.SavedTensorsByRegion.
"""

import argparse

import pytest
import torch
import torch.nn as nn

from dtbook.measure import SavedTensorsByRegion
from dtbook.metrics import read_metrics
from support import assert_inputs_checked, load_script, run_in_process, run_python, run_torchrun

SCRIPT = "ch8_tensor_parallel.py"


@pytest.mark.parametrize("seq_len, world, sequence_parallel, problem", [
    (30, 4, True, "windows of 30 tokens do not cut into 4 equal parts"),
    (30, 2, True, None),
    (30, 4, False, None),        # tensor parallelism alone does not cut the tokens
    (None, 4, True, None),       # the model's context, 64
    (100, 1, False, "--seq-len 100 is longer than the small model's context of 64"),
])
def test_the_windows_must_cut_into_equal_parts(seq_len, world, sequence_parallel, problem):
    program = load_script(SCRIPT)
    args = argparse.Namespace(model="small", seq_len=seq_len,
                              sequence_parallel=sequence_parallel, time_steps=None)
    assert_inputs_checked(program, args, world, problem)


def test_the_refusal_is_one_line_with_exit_2(monkeypatch, capsys):
    code = run_in_process(SCRIPT, "--sequence-parallel", "--seq-len", "100",
                          monkeypatch=monkeypatch)
    out = capsys.readouterr()
    assert code == 2
    assert out.err.strip() == ("error: --seq-len 100 is longer than the small model's context "
                               "of 64 positions")


def test_saved_tensors_count_each_region_apart():
    # A LayerNorm saves its input and two per-row statistics (mean, rstd); the linear layer
    # after it saves the LayerNorm's output. Parameters are excluded.
    norm, linear = nn.LayerNorm(8), nn.Linear(8, 4)
    x = torch.randn(3, 5, 8)
    params = [*norm.parameters(), *linear.parameters()]
    with SavedTensorsByRegion({"norms": [norm]}, params) as saved:
        linear(norm(x)).sum().backward()
    assert saved.bytes_by_region() == {"norms": (3 * 5 * 8 + 2 * 3 * 5) * 4,
                                       "other": 3 * 5 * 8 * 4}
    # With no module in the region everything counts as "other": the split is the hooks'.
    with SavedTensorsByRegion({"norms": []}, params) as whole:
        linear(norm(x)).sum().backward()
    assert whole.bytes_by_region() == {"norms": 0, "other": saved.bytes}
    # The hooks are gone afterwards: the LayerNorm runs with none.
    assert not norm._forward_pre_hooks and not norm._forward_hooks


def test_a_batch_of_one_still_saves_one_nth_in_the_layernorms(tmp_path):
    # (1, t, C)[:, r*t/N:(r+1)*t/N] is contiguous: .contiguous() would return the view, whose
    # storage is all t tokens, and the first LayerNorm would save the whole sequence.
    metrics = tmp_path / "m.jsonl"
    run_torchrun(SCRIPT, "--model", "tiny", "--sequence-parallel", "--api", "hand",
                 "--batch-size", "1", "--metrics", metrics, nproc=2, timeout=120)
    records = {r["version"]: r for r in read_metrics(metrics) if r.get("event") == "compare"}
    tp, sp = (records[v]["saved_bytes"] for v in ("tensor parallel", "sequence parallel"))
    assert sp["norms"] * 2 == tp["norms"]
    assert sp["other"] == tp["other"]
    # One window: the control's LayerNorm gradients are still half of what they should be.
    assert records["sequence parallel"]["grad_gap"] <= 1e-5
    assert records["control: LayerNorm grads not summed"]["grad_gap"] >= 1e-3


def test_a_world_of_one_cuts_nothing_so_even_the_control_agrees(tmp_path):
    # One rank holds all tokens: the all-gathers and reduce-scatters are called (the counts
    # of a step are the same as on N ranks) but move nothing, and there is no other rank's
    # gradient to forget. Same products, same order: equal to float32 resolution.
    metrics = tmp_path / "m.jsonl"
    run_python(SCRIPT, "--model", "tiny", "--sequence-parallel", "--batch-size", "2",
               "--metrics", metrics, timeout=60)
    records = {r["version"]: r for r in read_metrics(metrics) if r.get("event") == "compare"}
    assert list(records) == ["tensor parallel", "sequence parallel",
                             "control: LayerNorm grads not summed", "dtensor sequence parallel"]
    for r in records.values():
        assert max(r["logits_gap"], r["grad_gap"], r["update_gap"]) <= 1e-6, r
        assert all(row["traffic_bytes"] == 0 for row in r["collectives"].values())
        assert r["saved_bytes"] == records["tensor parallel"]["saved_bytes"]
    counts = {op: row["count"] for op, row in records["sequence parallel"]["collectives"].items()}
    assert counts == {"all_gather": 4 * 2 + 2, "reduce_scatter": 4 * 2, "all_reduce": 1}
