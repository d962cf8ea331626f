"""What scripts/ch8_experts.py promises that section 8.4 does not run.

The notebook launches the script on 2 processes and asserts the expert-parallel layer's outputs
and gradients equal to one process's, against a control that leaves the router's gradient
unsummed, and the tokens each rank computes under balanced and skewed routing. Here: inputs
refused in one line, and a world of one (every expert local, the exchanges with oneself), where
even the control is right, because there is no other rank's share to sum.
"""

import argparse

import pytest

from dtbook.metrics import read_metrics
from support import assert_inputs_checked, load_script, run_python

SCRIPT = "ch8_experts.py"


@pytest.fixture(scope="module")
def program():
    return load_script(SCRIPT)


@pytest.mark.parametrize("experts, skew, world, problem", [
    (4, 0.9, 3, "4 experts do not spread evenly over 3 processes"),
    (6, 0.9, 4, "6 experts do not spread evenly over 4 processes"),
    (4, 1.5, 2, "--skew is a share of the tokens"),
    (4, -0.1, 2, "--skew is a share of the tokens"),
    (8, 0.0, 4, None),
    (4, 1.0, 1, None),
])
def test_experts_must_spread_evenly_and_skew_is_a_share(program, experts, skew, world, problem):
    args = argparse.Namespace(experts=experts, skew=skew)
    assert_inputs_checked(program, args, world, problem)


def test_a_world_of_one_holds_every_expert_and_matches_even_without_the_sum(tmp_path):
    # Relative L2 gaps of one forward and backward: float32 rounding is a few 1e-7.
    metrics = tmp_path / "m.jsonl"
    run_python(SCRIPT, "--tokens", "128", "--width", "32", "--steps", "1", "--metrics", metrics,
               timeout=60)
    records = read_metrics(metrics)
    compare = [r for r in records if r.get("event") == "compare"]
    assert [r["version"] for r in compare] == ["expert parallel", "control: router grad unsummed"]
    for r in compare:
        assert r["output_gap"] <= 1e-5 and r["grad_gap"] <= 1e-5, r
    timing = {r["routing"]: r["tokens_per_rank"] for r in records if r.get("event") == "timing"}
    assert timing == {"balanced": [128], "skewed": [128]}
