"""Chapter 3, section 1: the minimal DDP against the real one, the initial broadcast, DDP's buckets."""

import pytest
import torch

from dtbook.metrics import read_metrics
from support import run_python, run_torchrun

NPROC = 2
CAP_MB = 0.02  # small enough that the tiny model needs several buckets


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("minimal_ddp")
    metrics, grads = out / "metrics.jsonl", out / "grads.pt"
    run_torchrun("ch3_minimal_ddp.py", "--model", "tiny", "--steps", 2, "--bucket-cap-mb", CAP_MB,
                 "--layout-caps-mb", f"{CAP_MB},25", "--metrics", metrics, "--save-gradients", grads,
                 nproc=NPROC, timeout=240)
    return read_metrics(metrics), torch.load(grads, weights_only=True)


def records(metrics, event):
    return [m for m in metrics if m.get("event") == event]


def max_gap(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_minimal_ddp_gradients_equal_real_ddp_and_one_process(two_rank_run):
    metrics, grads = two_rank_run
    scale = max(g.abs().max().item() for g in grads["ddp"])
    assert scale > 1e-3, "gradients must be non-trivial for the comparison to mean anything"
    assert len(records(metrics, "model")[0]["minimal_buckets"]) > 1, "the run must exercise several buckets"
    # Compared here from the saved tensors, not from the script's own figures.
    assert max_gap(grads["minimal"], grads["ddp"]) <= 1e-6 * scale
    assert max_gap(grads["ddp"], grads["single"]) <= 1e-5 * scale
    # A sum instead of a mean would be NPROC times the single-process gradient: far outside the tolerance.
    assert max_gap([g * NPROC for g in grads["ddp"]], grads["single"]) > 1e-2 * scale
    for step in records(metrics, "gradients"):  # every step, as measured across all ranks by the script
        assert step["max_diff_minimal_vs_ddp"] <= 1e-6 * step["max_abs_grad"]
        assert step["max_diff_ddp_vs_single_process"] <= 1e-5 * step["max_abs_grad"]


def test_ddp_divides_before_the_sum_and_two_ranks_cannot_tell(two_rank_run):
    """DDP's average has the bits of scale-then-sum; with 2 ranks sum-then-divide has them too.

    (The notebook's 3-process run shows the two orders differing.)
    """
    metrics, _ = two_rank_run
    (order,) = records(metrics, "division_order")
    assert order["world_size"] == NPROC and order["elements"] > 0
    assert order["ddp_vs_scale_first"] == 0
    assert order["ddp_vs_sum_first"] == order["scale_first_vs_sum_first"] == 0
    assert order["max_gap"] == 0 < order["largest"]


def test_wrapping_broadcasts_rank0_weights(two_rank_run):
    metrics, _ = two_rank_run
    rows = records(metrics, "replication")
    assert [r["rank"] for r in rows] == list(range(NPROC))
    assert all(r["before"] > 0 and r["ddp_before"] > 0 for r in rows if r["rank"] != 0), "ranks start different"
    assert all(r["after_minimal"] == 0 and r["after_ddp"] == 0 for r in rows), "wrapping makes them identical"
    assert all(r["minimal_vs_ddp_weights"] == 0 for r in rows)


def test_minimal_ddp_launches_buckets_during_backward(two_rank_run):
    metrics, _ = two_rank_run
    n_params = len(records(metrics, "model")[0]["names"])
    for step in records(metrics, "gradients"):
        launches = step["minimal_launches"]
        assert [b["bucket"] for b in launches] == list(range(len(launches)))
        assert launches[0]["grads_ready"] < n_params, "the first bucket must leave before backward ends"
        assert launches[-1]["grads_ready"] == n_params


def test_ddp_bucket_layout(two_rank_run):
    metrics, _ = two_rank_run
    model = records(metrics, "model")[0]
    n_params, param_bytes = len(model["names"]), model["bytes"]
    layouts = {(r["bucket_cap_mb"], r["iteration"]): r["buckets"] for r in records(metrics, "ddp_buckets")}
    logging = {r["bucket_cap_mb"]: r for r in records(metrics, "ddp_logging_data")}
    for cap in (CAP_MB, 25):
        first, rebuilt = layouts[(cap, 0)], layouts[(cap, 2)]
        assert len(first) == 1 and sorted(first[0]["param_indices"]) == list(range(n_params))
        assert [int(x) for x in logging[cap]["rebuilt_bucket_sizes"].split(",")] == [b["bytes"] for b in rebuilt]
        ready_order = [int(i) for i in logging[cap]["prev_iteration_grad_ready_order_indices"].split(",")]
        assert [i for b in rebuilt for i in b["param_indices"]] == ready_order
        assert sum(b["bytes"] for b in rebuilt) == sum(param_bytes)
        for b in rebuilt[:-1]:
            assert b["bytes"] - param_bytes[b["param_indices"][-1]] < cap * 2**20 <= b["bytes"]
    assert len(layouts[(CAP_MB, 2)]) > len(layouts[(25, 2)]) == 1


def test_world_of_one_without_launcher(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run_python("ch3_minimal_ddp.py", "--model", "tiny", "--steps", 1, "--layout-caps-mb", 25, "--metrics", metrics,
               timeout=180)
    step = records(read_metrics(metrics), "gradients")[0]
    assert step["max_diff_minimal_vs_ddp"] == 0
    assert step["max_diff_ddp_vs_single_process"] <= 1e-5 * step["max_abs_grad"]


@pytest.mark.parametrize("args, message", [
    (["--bucket-cap-mb", "0"], "--bucket-cap-mb"),
    (["--layout-caps-mb", "0.1,abc"], "--layout-caps-mb"),
    (["--steps", "-1"], "--steps"),
    (["--save-gradients", "/nonexistent-dir/grads.pt"], "--save-gradients"),
])
def test_bad_input_is_one_line(args, message):
    done = run_python("ch3_minimal_ddp.py", *args, check=False, timeout=60)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in done.stderr
