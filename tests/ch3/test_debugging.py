"""Chapter 3, debugging: each reproduced failure fails fast, with the message that names it, and its fix works.

Every failing run is bounded twice: by the script's process-group timeout (--timeout) and by the
subprocess timeout here, so a regression that turns an error back into a hang fails the test instead
of stalling the suite.

What the quick run of notebooks/ch3_ddp/03_debugging.ipynb already asserts is not launched again here:
the timeout error of a mismatched collective and DETAIL's names for it, DDP's unused-parameter error and
find_unused_parameters as its remedy, the three rank-seed runs, and the bad record with one and two
processes. The runs the quick notebook skips, and the script's flag checks, are tested below.
"""

import time

import pytest

from dtbook.metrics import read_metrics
from support import run_python, run_torchrun

SCRIPT = "ch3_failures.py"
PG_TIMEOUT = 4  # seconds: short, but with room for a slow start on busy shared cores
LIMIT = 90  # seconds any single run may take before the test fails


def output(done) -> str:
    return done.stdout + done.stderr


def failing_run(*args, env=None):
    start = time.perf_counter()
    done = run_torchrun(SCRIPT, *args, "--timeout", PG_TIMEOUT, env=env, check=False, timeout=LIMIT)
    assert done.returncode != 0, output(done)
    return output(done), time.perf_counter() - start


def test_fixed_collectives_pass_the_detail_check():
    done = run_torchrun(SCRIPT, "--failure", "mismatched-collective", "--fixed", "--timeout", PG_TIMEOUT,
                        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=LIMIT)
    assert "rank 0: finished every epoch" in done.stdout and "rank 1: finished every epoch" in done.stdout
    assert "Detected mismatch" not in output(done)


def test_monitored_barrier_names_the_missing_rank():
    text, _ = failing_run("--failure", "stuck-rank")
    assert f"Rank 1 failed to pass monitoredBarrier in {PG_TIMEOUT * 1000} ms" in text
    assert "rank 1: passed the barrier" not in text  # rank 0's error ended the run while rank 1 was still stuck


def test_static_graph_remedy_for_unused_parameters_trains(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run_torchrun(SCRIPT, "--failure", "unused-parameter", "--steps", 3, "--static-graph", "--metrics", metrics,
                 timeout=LIMIT)
    records = read_metrics(metrics)
    assert [r["step"] for r in records if r["event"] == "step"] == [0, 1, 2]
    summary = next(r for r in records if r["event"] == "summary")
    assert summary["aux_head_has_grad"] is False  # the unused head was skipped, not given a made-up gradient


def divergence(tmp_path, *args) -> dict:
    metrics = tmp_path / "m.jsonl"
    run_torchrun(SCRIPT, "--failure", "rank-seed", "--steps", 5, *args, "--metrics", metrics, timeout=LIMIT)
    return next(r for r in read_metrics(metrics) if r["event"] == "divergence")


def test_ddp_broadcast_covers_parameters_but_not_plain_tensors(tmp_path):
    spread = divergence(tmp_path, "--model-seed", "per-rank", "--ddp")
    assert spread["parameter_spread"] == 0
    assert spread["projection_spread"] > 0 and spread["output_spread"] > 0


def test_find_unused_cost_benchmark_settings_agree(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run_torchrun("ch3_find_unused_cost.py", "--steps", 2, "--warmup", 1, "--metrics", metrics, timeout=LIMIT)
    records = read_metrics(metrics)
    settings = {r["setting"]: r for r in records if r["event"] == "setting"}
    assert set(settings) == {"default", "find_unused_parameters", "static_graph"}
    assert all(r["steps"] == 2 for r in settings.values())
    summary = next(r for r in records if r["event"] == "summary")
    assert summary["autograd_nodes"] > 0
    assert summary["weight_difference"] == 0  # the flags change bookkeeping, never the arithmetic


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--failure", "rank-seed", "--fixed"], "--fixed applies only to --failure mismatched-collective"),
        (["--failure", "unused-parameter", "--find-unused-parameters", "--static-graph"],
         "choose one of --find-unused-parameters and --static-graph"),
        (["--failure", "mismatched-collective"], "needs at least 2 processes"),
        (["--failure", "uneven-inputs"], "needs at least 2 processes"),
        (["--failure", "bad-record", "--join"], "--join applies only to --failure uneven-inputs"),
        (["--failure", "rank-seed", "--all-variants", "--ddp"], "--all-variants runs every --model-seed"),
        (["--failure", "rank-seed", "--ddp-own-group"],
         "--ddp-own-group applies only to --failure ddp-under-detail"),
    ],
)
def test_bad_flags_give_one_line(args, message):
    done = run_python(SCRIPT, *args, check=False, timeout=LIMIT)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_a_zero_timeout_is_refused_by_argparse():
    done = run_python(SCRIPT, "--timeout", "0", check=False, timeout=LIMIT)
    assert done.returncode == 2
    assert "error: argument" in done.stderr.splitlines()[-1]
    assert "Traceback" not in done.stderr
