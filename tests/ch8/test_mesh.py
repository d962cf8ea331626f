"""What scripts/ch8_mesh.py promises that section 8.7 does not run.

The notebook launches the script on 4 processes (dp 2 x tp 2, and the checkpoint moved FSDP ->
FSDP x TP -> FSDP) and on 8 (pp 2 x dp 2 x tp 2), and asserts: each rank's groups and the rows
of qkv it holds, the placements of that parameter, the final weights the same training as one
process's against two controls, and both checkpoint moves ending in the same bits against two
controls. Here: meshes refused in one line before any process group; a world of one, where the
control that feeds every dp rank the same slice cannot fail (there is one slice); another
3-D shape; and the checkpoint moves on two processes (FSDP over 2 -> dp 1 x tp 2 -> FSDP).
"""

import argparse

import pytest

from dtbook.compare import same_training_tolerance
from dtbook.metrics import read_metrics
from support import assert_inputs_checked, load_script, run_python, run_torchrun

SCRIPT = "ch8_mesh.py"


@pytest.fixture(scope="module")
def program():
    return load_script(SCRIPT)


def namespace(model="tiny", tp=2, pp=1, dp=None, steps=4, batch_size=4, microbatches=2,
              corpus_tokens=20_000, relayout=None):
    return argparse.Namespace(model=model, tp=tp, pp=pp, dp=dp, steps=steps,
                              batch_size=batch_size, microbatches=microbatches,
                              corpus_tokens=corpus_tokens, relayout=relayout)


@pytest.mark.parametrize("args, world, problem", [
    (namespace(dp=2), 8, "the mesh pp 1 x dp 2 x tp 2 holds 4 processes, but the world has 8"),
    (namespace(dp=4), 4, "the mesh pp 1 x dp 4 x tp 2 holds 8 processes, but the world has 4"),
    (namespace(pp=2), 6, "6 processes do not split into pp 2 x tp 2"),
    (namespace(tp=4), 4, "2 attention heads do not split over tp 4"),
    (namespace(model="large", pp=4, tp=1), 4, "6 blocks do not split into 4 stages"),
    (namespace(pp=2, batch_size=3), 4, "--batch-size 3 does not split into 2 micro-batches"),
    (namespace(steps=100), 4, "raise --corpus-tokens"),
    (namespace(relayout="d", tp=1), 4, "--relayout moves a checkpoint"),
    (namespace(relayout="d", pp=2), 8, "--relayout moves a checkpoint"),
    (namespace(relayout="d", steps=1), 4, "--relayout saves the last two steps"),
    (namespace(), 4, None),
    (namespace(pp=2), 8, None),
    (namespace(dp=1, tp=1), 1, None),
])
def test_meshes_that_do_not_fit_are_refused(program, args, world, problem):
    assert_inputs_checked(program, args, world, problem)


def test_the_refusal_is_one_line_and_exit_2_before_any_process_group():
    # WORLD_SIZE as torchrun would set it: the check runs before init_process_group.
    done = run_python(SCRIPT, "--dp", "2", env={"WORLD_SIZE": "8", "RANK": "0"}, check=False,
                      timeout=60)
    assert done.returncode == 2
    assert done.output.strip().count("\n") == 0, done.output
    assert "error: the mesh pp 1 x dp 2 x tp 2 holds 4 processes, but the world has 8" in done.output
    assert "Traceback" not in done.output


def records(path, event):
    return [r for r in read_metrics(path) if r.get("event") == event]


def test_a_world_of_one_has_one_slice_so_the_data_control_cannot_fail(tmp_path):
    # dp 1 x tp 1: FSDP over one rank, nothing split. "Every dp rank fed the same slice" is
    # the only possible feeding, so the control that fails on dp 2 trains exactly as the
    # run does; the other control (one process, a step fewer) still fails.
    metrics = tmp_path / "m.jsonl"
    run_python(SCRIPT, "--tp", "1", "--steps", "3", "--metrics", metrics, timeout=60)
    [result] = records(metrics, "compare")
    tolerance = same_training_tolerance(result["steps"])
    controls = result["controls"]
    assert result["runs"]["mesh"] * 10 <= tolerance
    assert controls["control: dp ranks share a slice"] * 10 <= tolerance
    assert controls["control: one process, a step fewer"] >= 10 * tolerance
    [placed] = records(metrics, "placements")
    assert placed["mesh"] == ["dp"] and placed["placements"] == "(Shard(dim=0),)"


def test_pipeline_and_tensor_parallel_without_data_parallel(tmp_path):
    # pp 2 x dp 1 x tp 2 on four processes: the stages' blocks split over tp, FSDP over one
    # rank, the tied gradients added over the (first, last) stage pair of each tp rank.
    metrics = tmp_path / "m.jsonl"
    run_torchrun(SCRIPT, "--pp", "2", "--tp", "2", "--steps", "3", "--metrics", metrics,
                 nproc=4, timeout=180)
    [mesh] = records(metrics, "mesh")
    assert mesh["dims"] == ["pp", "dp", "tp"] and mesh["shape"] == [2, 1, 2]
    [result] = records(metrics, "compare")
    tolerance = same_training_tolerance(result["steps"])
    assert result["runs"]["mesh"] * 10 <= tolerance
    assert result["controls"]["control: one process, a step fewer"] >= 10 * tolerance
    # With one dp rank there is one slice: the data control equals the run.
    assert result["controls"]["control: dp ranks share a slice"] * 10 <= tolerance


def test_a_checkpoint_moves_between_layouts_on_two_processes(tmp_path):
    # FSDP over 2 -> dp 1 x tp 2 -> FSDP over 2: the same bits after each move; the
    # checkpoint of the step before, and the qkv rows left unregrouped, differ.
    metrics = tmp_path / "m.jsonl"
    run_torchrun(SCRIPT, "--tp", "2", "--steps", "2", "--relayout", tmp_path / "dcp",
                 "--metrics", metrics, nproc=2, timeout=180)
    moves = {m["move"]: m for m in records(metrics, "relayout")}
    assert [m["equal"] for m in moves.values()] == [True, True, False, False]
    assert moves["control: qkv rows not regrouped"]["gap"] > 0
    layouts = {p["layout"]: p for p in records(metrics, "placements")}
    assert layouts["FSDP"]["placements"] == "(Shard(dim=0),)"
    # dp 1: FSDP's cut of one is a plain Shard(0), tp's rows are split in two.
    assert layouts["FSDP x TP"]["mesh_shape"] == [1, 2]
