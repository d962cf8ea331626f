"""What scripts/ch8_ring_attention.py promises that section 8.5 does not run.

The notebook launches the script on 2 and 4 processes and asserts outputs and q/k/v gradients
equal to causal attention on one process, against a control without the online-softmax
rescaling, and the saved bytes per rank growing as r + 1. Here: a sequence that does not cut
evenly refused in one line, and a world of one (one block, no ring), where ring attention is
plain causal attention and the control, with nothing to rescale, agrees too.
"""

import argparse

import pytest

from dtbook.metrics import read_metrics
from support import assert_inputs_checked, load_script, run_python

SCRIPT = "ch8_ring_attention.py"


@pytest.mark.parametrize("seq_len, world, problem", [
    (1000, 3, "1000 tokens does not cut into 3 equal blocks"),
    (1024, 3, "1024 tokens does not cut into 3 equal blocks"),
    (1024, 4, None),
    (7, 1, None),
])
def test_the_sequence_must_cut_into_equal_blocks(seq_len, world, problem):
    program = load_script(SCRIPT)
    args = argparse.Namespace(seq_len=seq_len)
    assert_inputs_checked(program, args, world, problem)


def test_a_world_of_one_is_plain_causal_attention(tmp_path):
    # One block holds the whole sequence: a single maximum, nothing to rescale, so even the
    # control agrees. Relative L2 gaps: float32 rounding is about 1e-7.
    metrics = tmp_path / "m.jsonl"
    run_python(SCRIPT, "--seq-len", "128", "--metrics", metrics, timeout=60)
    compare = [r for r in read_metrics(metrics) if r.get("event") == "compare"]
    assert [r["version"] for r in compare] == ["ring attention", "control: no rescaling"]
    for r in compare:
        assert r["output_gap"] <= 1e-5 and r["grad_gap"] <= 1e-5, r
