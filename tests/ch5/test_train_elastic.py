"""ch3_train.py's additions for clusters: --global-batch-size, and stopping on a scheduler's signal."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from dtbook.cli import ScriptError
from support import REPO, SCRIPTS, load_script


@pytest.fixture(scope="module")
def train():
    return load_script("ch3_train.py")


@pytest.mark.parametrize("world_size, batch_size, accum", [(2, 8, 1), (1, 8, 2), (4, 2, 2), (1, 1, 16)])
def test_global_batch_size_sets_the_accumulation(train, world_size, batch_size, accum):
    assert train.accumulation_for(16, world_size, batch_size) == accum


def test_a_global_batch_that_does_not_divide_is_one_clear_error(train):
    with pytest.raises(ScriptError, match=r"--global-batch-size 16 is not a multiple of 3 process\(es\) x "
                                          r"--batch-size 8 = 24"):
        train.accumulation_for(16, 3, 8)


def test_global_batch_size_and_accum_steps_exclude_each_other(train, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--global-batch-size", "16", "--accum-steps", "2"])
    assert exit_info.value.code == 2
    assert "give only one of them" in capsys.readouterr().err


def test_sigusr1_stops_at_a_step_boundary_with_a_checkpoint(tmp_path):
    """A world of one: the signal arrives mid-run; the run saves the step it finished and exits 128 + 10."""
    metrics = tmp_path / "metrics.jsonl"
    run = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "ch3_train.py"), "--model", "tiny", "--corpus-tokens", "20000",
         "--max-steps", "5000", "--batch-size", "8", "--log-every", "1", "--save-every", "1000",
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics", str(metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin",
             "PYTHONPATH": str(SCRIPTS)})
    try:
        deadline = time.monotonic() + 240
        while not run.stdout.readline().startswith("step "):  # the first optimizer step is done
            assert time.monotonic() < deadline and run.poll() is None
        run.send_signal(signal.SIGUSR1)
        out, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 128 + signal.SIGUSR1, err
    assert "Traceback" not in err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (stopped,) = [r for r in records if r["event"] == "stopped"]
    last_step = max(r["step"] for r in records if r["event"] == "step")
    assert stopped["signal"] == "SIGUSR1" and stopped["step"] == last_step < 5000
    ckpt = torch.load(tmp_path / "ckpt" / f"ckpt_step{last_step:08d}.pt", weights_only=True)
    assert ckpt["step"] == last_step
    assert f"SIGUSR1: stopped after step {last_step}" in out
