"""What scripts/ch8_pipeline.py promises that section 8.3 does not run.

The notebook launches the script on 2 stages and asserts: micro-batch losses and gradients of
the hand-written GPipe (1, 2, 4, 8 micro-batches) and of ScheduleGPipe, Schedule1F1B and
ScheduleInterleaved1F1B equal to one process, against a control that leaves the tied
gradients unadded; causality in every recorded timeline; the bubble at one micro-batch; peak
activations of GPipe against 1F1B; and the reproduced hang (a send without its recv), ended
by a timeout with one line per rank. Here: inputs refused in one line, and a world of one,
where every schedule, the interleaved one with two stages on the same rank included, still
equals the reference.
"""

import argparse

import pytest

from dtbook.metrics import read_metrics
from support import assert_inputs_checked, load_script, run_python

SCRIPT = "ch8_pipeline.py"


@pytest.fixture(scope="module")
def program():
    return load_script(SCRIPT)


def namespace(model="medium", batch_size=16, microbatches=(1, 2, 4, 8), drop_send=None,
              timeout=None, time_steps=None):
    return argparse.Namespace(model=model, batch_size=batch_size, microbatches=list(microbatches),
                              drop_send=drop_send, timeout=timeout, time_steps=time_steps)


@pytest.mark.parametrize("args, world, problem", [
    (namespace(), 3, "4 blocks do not split into 3 stages"),
    (namespace(model="large"), 4, "6 blocks do not split into 4 stages"),
    (namespace(batch_size=12), 2, "--batch-size 12 does not split into 8 micro-batches"),
    (namespace(drop_send=1, microbatches=[1, 2]), 2, "--drop-send 1 is not a micro-batch"),
    (namespace(drop_send=0), 2, "give it a --timeout"),
    (namespace(time_steps=5), 1, "--time-steps times a pipeline: launch 2 or more"),
    (namespace(time_steps=5), 2, None),
    (namespace(model="large"), 3, None),
    (namespace(drop_send=0, timeout=5), 4, None),
])
def test_inputs_that_cannot_be_cut_evenly_are_refused(program, args, world, problem):
    assert_inputs_checked(program, args, world, problem)


def test_a_world_of_one_is_one_stage_and_every_schedule_equals_the_reference(tmp_path):
    # One rank holds every stage (two, for the interleaved schedule: the case where a tied
    # weight shared by two stages would be scaled twice). Relative L2 gap of one step's
    # gradients: float32 rounding is a few 1e-7; 1e-5 as in the notebook.
    metrics = tmp_path / "m.jsonl"
    run_python(SCRIPT, "--model", "tiny", "--batch-size", "4", "--microbatches", "1", "2",
               "--repeats", "1", "--metrics", metrics, timeout=60)
    rows = [r for r in read_metrics(metrics) if r.get("event") == "pipeline"]
    assert [r["schedule"] for r in rows] == ["GPipe by hand", "GPipe by hand", "ScheduleGPipe",
                                             "Schedule1F1B", "ScheduleInterleaved1F1B"]
    for r in rows:
        assert r["grad_gap"] <= 1e-5, r


def test_timing_a_world_of_one_is_refused_in_one_line():
    # Section 8.8 times GPipe across a link; one process has no stage to send to.
    done = run_python(SCRIPT, "--time-steps", "3", check=False, timeout=60)
    assert done.returncode == 2
    assert done.output.strip().count("\n") == 0, done.output
    assert done.output.startswith("error: --time-steps times a pipeline"), done.output
