"""What scripts/ch8_tensor_parallel.py promises that the notebooks do not run.

Sections 8.1 and 8.2 launch the script on 2 and 4 processes and assert, each against a control
that must fail: logits and every weight gradient equal to one process (hand-written and
DTensor), DTensor equal to the hand-written version, the parameters each rank holds and the
all-reduces and bytes of a step against the formulas, the placements DTensor reports. Here: the
cutting of weights (shard and unshard are inverses, and a rank's qkv slice is its own heads),
the refusal of a world size that does not divide the heads, in one line with exit 2.
"""

import argparse

import pytest
import torch

from dtbook.metrics import read_metrics
from support import assert_inputs_checked, load_script, run_python

SCRIPT = "ch8_tensor_parallel.py"


@pytest.fixture(scope="module")
def program():
    return load_script(SCRIPT)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dim, parts", [(0, 3), (0, 1), (1, 1)])
def test_unshard_puts_every_rank_slice_back_in_place(program, world, dim, parts):
    full = torch.arange(12 * 8, dtype=torch.float32).view(12, 8)
    shards = [program.shard(full, dim, parts, rank, world) for rank in range(world)]
    assert all(s.numel() == full.numel() // world for s in shards)
    assert torch.equal(program.unshard(shards, dim, parts), full)


def test_a_rank_keeps_the_q_k_and_v_rows_of_its_own_heads(program):
    # Rows of a fused qkv weight for C = 4 (two heads of 2): q = 0-3, k = 4-7, v = 8-11.
    rows = torch.arange(12).view(12, 1)
    assert program.shard(rows, 0, 3, 1, 2).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    # Cutting the fused weight in one piece would give rank 0 all of q and half of k.
    assert rows.chunk(2)[0].flatten().tolist() != program.shard(rows, 0, 3, 0, 2).flatten().tolist()


@pytest.mark.parametrize("model, world, problem", [
    ("tiny", 4, "2 attention heads do not split over 4 processes"),
    ("small", 3, "4 attention heads do not split over 3 processes"),
    ("large", 8, None),
    ("small", 1, None),
])
def test_a_world_size_must_divide_the_heads(program, model, world, problem):
    args = argparse.Namespace(model=model, seq_len=None, sequence_parallel=False,
                              time_steps=None)
    assert_inputs_checked(program, args, world, problem)


@pytest.mark.parametrize("world, problem", [
    (1, "--time-steps compares tensor parallelism with one process: launch 2 or more"),
    (2, None),
])
def test_timing_needs_a_second_process_to_place(program, world, problem):
    # Section 8.8 places two processes on one host or on two; a world of one has nothing
    # to place, and a timing of it would compare one process with itself.
    args = argparse.Namespace(model="tiny", seq_len=None, sequence_parallel=False,
                              time_steps=5)
    assert_inputs_checked(program, args, world, problem)


@pytest.mark.parametrize("value, problem", [("0", "must be at least 1, got 0"),
                                            ("ten", "expected a whole number, got 'ten'")])
def test_time_steps_must_be_a_positive_count(program, capsys, value, problem):
    with pytest.raises(SystemExit) as exited:
        program.parse_args(["--time-steps", value])
    assert exited.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and problem in errors[0], errors


def test_the_refusal_is_one_line_and_exit_2_before_any_process_group():
    # WORLD_SIZE as torchrun would set it: the check runs before init_process_group, so one
    # process is enough to see what every rank prints.
    done = run_python(SCRIPT, "--model", "tiny", env={"WORLD_SIZE": "4", "RANK": "0"},
                      check=False, timeout=60)
    assert done.returncode == 2
    assert done.output.strip().count("\n") == 0, done.output
    assert "error: the tiny model's 2 attention heads do not split over 4" in done.output
    assert "Traceback" not in done.output


def test_a_world_of_one_splits_nothing_so_even_the_controls_agree(tmp_path):
    # With one rank there is no other rank's share to miss: f's all-reduce and the row order
    # of qkv change nothing, so the controls, which fail on 2 and 4 ranks, pass here. Same
    # products in the same order as the unsplit model: equal to float32 resolution.
    metrics = tmp_path / "m.jsonl"
    run_python(SCRIPT, "--model", "tiny", "--batch-size", "2", "--metrics", metrics, timeout=60)
    records = [r for r in read_metrics(metrics) if r.get("event") == "compare"]
    assert len(records) == 4
    for r in records:
        assert r["logits_gap"] <= 1e-6 and r["grad_gap"] <= 1e-6, r
    # The hand-written blocks call all_reduce anyway: 4 per block (2 blocks), the f-less
    # control half of them, none sending a byte. DTensor skips collectives on a 1-rank mesh.
    counts = {r["version"]: r["all_reduces"] for r in records}
    assert counts == {"hand": 8, "control: f without all-reduce": 4, "dtensor": 0,
                      "control: qkv cut in one piece": 0}
    assert all(r["traffic_bytes"] == 0 for r in records)
