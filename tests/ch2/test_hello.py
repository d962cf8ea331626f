"""scripts/ch2_hello_distributed.py: every rank reports in and the all-reduce matches W(W+1)/2."""

import json

import pytest

from support import run_python, run_torchrun


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_matches_the_formula(tmp_path, world):
    metrics = tmp_path / "m.jsonl"
    run_torchrun("ch2_hello_distributed.py", "--metrics", metrics, nproc=world, timeout=120)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    ranks = [r for r in records if r["event"] == "rank"]
    assert sorted(r["rank"] for r in ranks) == list(range(world))
    assert {r["world_size"] for r in ranks} == {world}
    reduced = next(r for r in records if r["event"] == "all_reduce")
    assert reduced["result"] == world * (world + 1) / 2
    provenance = records[0]
    assert provenance["event"] == "provenance" and provenance["world_size"] == world


def test_runs_without_a_launcher():
    done = run_python("ch2_hello_distributed.py", timeout=120)
    assert "rank 0/1" in done.output


def test_nccl_without_gpus_is_one_clear_error():
    # GPUs hidden, so that the refusal is checked on a GPU machine too
    done = run_python("ch2_hello_distributed.py", "--backend", "nccl", check=False, timeout=120,
                      env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode != 0
    assert "error: --backend nccl needs one CUDA GPU" in done.output
    assert "Traceback" not in done.output


def test_help_and_bad_flags():
    assert "all-reduce" in run_python("ch2_hello_distributed.py", "--help").output
    done = run_python("ch2_hello_distributed.py", "--backend", "mpi", check=False)
    assert done.returncode == 2 and "invalid choice" in done.output and "Traceback" not in done.output
