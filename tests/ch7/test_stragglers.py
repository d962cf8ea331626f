"""Chapter 7, section 7: what the straggler section does not run.

The notebook launches 3 processes, rank 1's forward delayed from the middle of the run on, and
asserts that rank 1 is flagged in every check after the fault and named a straggler, and nobody
before it. Here: the inputs refused in one line; the rule and the verdict in process (a rank just
under the factor, one unlucky window, two ranks of two).
"""

import argparse

import pytest
import torch

from support import assert_inputs_checked, load_script, run_in_process

SCRIPT = "ch7_stragglers.py"


@pytest.fixture(scope="module")
def program():
    return load_script(SCRIPT)


@pytest.mark.parametrize("slow_rank, world, factor, every, confirm, from_step, problem", [
    (3, 3, 2.0, 10, 2, 1, "--slow-rank 3 is not a rank of this world of 3 process"),
    (2, 2, 2.0, 10, 2, 1, "--slow-rank 2 is not a rank of this world of 2 process"),
    (-1, 2, 2.0, 10, 2, 1, "--slow-rank -1 is not a rank"),
    (None, 1, 2.0, 10, 2, 1, "run 2 or more processes"),
    (None, 2, 1.0, 10, 2, 1, "give a factor above 1"),
    (None, 2, 2.0, 2, 2, 1, "a check needs 3 or more steps"),
    (None, 2, 2.0, 41, 1, 1, "must hold at least one check"),
    (None, 2, 2.0, 10, 5, 1, "--confirm 5 needs that many checks, but --steps 40 makes 4"),
    (1, 2, 2.0, 10, 2, 41, "--slow-from-step 41 is after the last step"),
    (2, 3, 2.0, 10, 4, 40, None),
    (None, 2, 1.5, 40, 1, 1, None),
])
def test_inputs_are_checked(program, slow_rank, world, factor, every, confirm, from_step, problem):
    args = argparse.Namespace(slow_rank=slow_rank, factor=factor, every=every, steps=40,
                              confirm=confirm, slow_from_step=from_step)
    assert_inputs_checked(program, args, world, problem)


def test_a_slow_rank_outside_the_world_is_one_line_and_exit_2(monkeypatch, capsys):
    code = run_in_process(SCRIPT, "--slow-rank", "1", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: --slow-rank 1 is not a rank of this world of 1 process")


@pytest.mark.parametrize("flags", [("--slow-ms", "20"), ("--slow-from-step", "5")])
def test_a_delay_needs_a_rank(monkeypatch, capsys, flags):
    assert run_in_process(SCRIPT, *flags, monkeypatch=monkeypatch) == 2
    assert "delay the forward of --slow-rank: give --slow-rank too" in capsys.readouterr().err


def test_the_rule_compares_each_rank_with_the_median_of_the_others(program):
    normal, slow = [10.0, 11.0, 9.0], [30.0, 31.0, 29.0]
    assert program.find_stragglers([normal, slow, normal], 2.0) == [1]
    assert program.find_stragglers([normal, normal, normal], 2.0) == []
    # Control: 1.9x the others is under a factor of 2, and one outlier step moves no median.
    assert program.find_stragglers([normal, [19.0, 19.0, 95.0], normal], 2.0) == []
    # Two slow ranks of three: no single rank stands out against the others, none is flagged.
    assert program.find_stragglers([normal, slow, slow], 2.0) == []
    assert program.find_stragglers([slow, normal], 2.0) == [0]


def test_a_straggler_is_named_after_two_flagged_checks_in_a_row(program, capsys):
    """The verdict needs --confirm checks in a row: one unlucky window names nobody."""
    watch = program.StragglerWatch(world=3, factor=2.0, confirm=2)
    normal, slow = [10.0, 11.0, 9.0], [30.0, 31.0, 29.0]

    def check(compute):  # [rank, step, part]: waited 1 ms, total = compute + 1 ms
        times = torch.tensor([[[ms, 1.0, ms + 1.0] for ms in steps] for steps in compute])
        return watch.check(times, first_step=1)

    verdicts = [check(c)["stragglers"] for c in (
        [normal, slow, normal],   # flagged once...
        [normal, normal, normal],  # ...and not again: nobody named
        [normal, normal, slow],   # rank 2 flagged...
        [normal, normal, slow])]  # ...twice in a row: named
    assert verdicts == [[], [], [], [2]]
    assert watch.named_at == {2: 4} and "rank 2 (at check 4)" in watch.summary()
    capsys.readouterr()
