"""Chapter 3, section 4: DDP's performance knobs do what the chapter says, and its measuring tools work.

The measurements run on the tiny model with two processes; the tests check properties that hold
whatever the timings are (timings on shared cores prove nothing and are not asserted).
"""

import json
import re
import sys

import pytest

from dtbook.exposed import exposed_fraction
from dtbook.metrics import read_metrics
from dtbook.model import GPT, MODEL_SIZES
from support import run_python, run_torchrun

ACCUM = 3
ACCUMULATION_TOLERANCE = 1e-4  # of the largest gradient entry; see the test below
CAPS = [0.01, 0.03, 1.0]  # MiB; the tiny model's gradients take about 0.14 MiB


@pytest.fixture(scope="module")
def knobs(tmp_path_factory):
    metrics = tmp_path_factory.mktemp("knobs") / "metrics.jsonl"
    run_torchrun("ch3_ddp_knobs.py", "--experiments", "buckets", "accumulation", "options", "buffers",
                 "--model", "tiny", "--sweep-model", "tiny", "--bucket-caps", *CAPS, "--bucket-cap-mb", 0.03,
                 "--steps", 1, "--accum-steps", ACCUM, "--metrics", metrics, timeout=240)
    records = read_metrics(metrics)
    assert records[0]["event"] == "provenance" and records[0]["world_size"] == 2
    return records


def of(records, event):
    return [r for r in records if r["event"] == event]


def test_no_sync_all_reduces_once_per_optimizer_step_and_accumulates_the_same_gradients(knobs):
    modes = {r["mode"]: r for r in of(knobs, "accumulation")}
    synced, skipped = modes["sync every micro-batch"], modes["no_sync"]
    assert skipped["buckets"] == synced["buckets"] > 1
    assert synced["all_reduces_per_optimizer_step"] == ACCUM * synced["buckets"]
    assert skipped["all_reduces_per_optimizer_step"] == skipped["buckets"]
    grads = of(knobs, "accumulation_grads")[0]
    # The two loops add the same 3 x 2 gradient contributions in another order, so they differ by
    # fp32 rounding, which scales with the size of the summed terms: measure it against the largest
    # gradient entry. 1e-4 of it is about 800 float32 epsilons (2**-23), well above any summation
    # order on any CPU (measured: about 5e-6), and far below the control: gradients that were never
    # all-reduced (every micro-batch inside no_sync) are off by the order of the gradient itself.
    assert grads["relative_difference"] < ACCUMULATION_TOLERANCE < grads["control_relative_difference"]


def test_bucket_count_falls_as_the_cap_grows_and_buckets_cover_every_gradient(knobs):
    sweep = [r for r in of(knobs, "buckets") if r["cap_mb"] is not None]
    assert [r["cap_mb"] for r in sweep] == CAPS
    counts = [r["buckets"] for r in sweep]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1] == 1
    params = list(GPT(MODEL_SIZES["tiny"]).parameters())
    total = sum(p.numel() * 4 for p in params)
    largest = max(p.numel() * 4 for p in params)
    for r in of(knobs, "buckets"):
        assert sum(r["bucket_bytes"]) == total  # every gradient in exactly one bucket
        if r["cap_mb"] is not None:  # a bucket closes once it reaches the cap, so it overshoots by < 1 parameter
            assert max(r["bucket_bytes"]) < r["cap_mb"] * 2**20 + largest


def test_gradient_as_bucket_view_puts_gradients_inside_the_buckets_and_changes_no_weight(knobs):
    configs = {r["config"]: r for r in of(knobs, "options")}
    default, view = configs["default"], configs["gradient_as_bucket_view=True"]
    assert default["grads_in_buckets"] == 0
    assert view["grads_in_buckets"] == view["params"]
    assert view["gradient_memory_bytes"] == view["bucket_bytes"] == view["grad_bytes"]
    assert default["gradient_memory_bytes"] == 2 * default["grad_bytes"]
    assert set(configs) == {"default", "gradient_as_bucket_view=True", "static_graph=True"}
    assert all(r["max_weight_difference"] == 0.0 for r in configs.values())


def test_the_sweep_keeps_every_steps_time_for_the_spread(knobs):
    for r in of(knobs, "buckets"):
        assert len(r["step_ms_all"]) == 1  # --steps 1 above
        assert r["step_ms"] == r["step_ms_all"][0]


def test_forward_sync_buffers_copies_rank_0s_statistics_at_every_forward(knobs):
    runs = {r["forward_sync_buffers"]: r for r in of(knobs, "buffers")}
    assert all(runs[True]["equal_at_forward_start"])
    assert runs[False]["equal_at_forward_start"][0] and not any(runs[False]["equal_at_forward_start"][1:])
    assert not runs[True]["equal_after_last_forward"]  # each rank's own batch updated it since


def test_overlap_benchmark_prints_its_table(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    done = run_torchrun("ch3_overlap_benchmark.py", "--model", "tiny", "--steps", 2, "--repeats", 1, "--warmup", 1,
                        "--bucket-cap-mb", 0.01, 1, "--metrics", metrics, timeout=240)
    assert "exposed waited/T_comm" in done.output and "first look (T_ddp-T_local)/T_comm" in done.output
    rows = [r for r in read_metrics(metrics) if r["event"] == "overlap"]
    assert [r["bucket_cap_mb"] for r in rows] == [0.01, 1]
    assert rows[0]["buckets"] > rows[1]["buckets"] == 1
    for r in rows:
        # the book's one exposed fraction, from the per-step samples the run recorded
        assert r["exposed"] == exposed_fraction(r["waited_samples_ms"], r["t_comm_samples_ms"], 2)
        look = r["first_look"]
        assert look["fraction"] == pytest.approx((r["t_ddp_ms"] - r["t_local_ms"]) / r["t_comm_ms"])
        assert look["low"] <= look["fraction"] <= look["high"]
        printed = re.search(rf"^\s+{r['bucket_cap_mb']:g}\s+{r['buckets']}\s.*\s(-?\d+\.\d\d) \(", done.output, re.M)
        assert printed and float(printed.group(1)) == pytest.approx(look["fraction"], abs=0.006)


def test_profiler_trace_is_valid_json_with_all_reduces_launched_during_backward(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    run_torchrun("ch3_profile_step.py", "--model", "tiny", "--bucket-cap-mb", 0.03, "--trace-dir", tmp_path / "trace",
                 "--metrics", metrics, timeout=240)
    summary = [r for r in read_metrics(metrics) if r["event"] == "summary"][0]
    assert summary["buckets"] >= 2
    for rank in (0, 1):
        events = json.loads((tmp_path / "trace" / f"rank{rank}.json").read_text())["traceEvents"]
        names = [e.get("name", "") for e in events]
        assert names.count("c10d::allreduce_") == summary["buckets"]
        assert names.count("gloo:all_reduce") + names.count("nccl:all_reduce") == summary["buckets"]
        assert {"forward", "backward", "optimizer"} <= set(names)
        # DDP scales every gradient by 1/W as it copies it into its bucket: one mul_out each,
        # all of a bucket's before that bucket's all-reduce is launched.
        scaled = sorted(e["ts"] for e in events if e.get("name") == "torch::distributed::reducer::mul_out")
        launched = sorted(e["ts"] for e in events if e.get("name") == "c10d::allreduce_")
        assert len(scaled) == summary["params"] == sum(summary["params_per_bucket"])
        ready = 0
        for launch, size in zip(launched, summary["params_per_bucket"], strict=True):
            ready += size
            assert sum(t <= launch for t in scaled) >= ready
    assert summary["all_reduce_launches"] == summary["all_reduce_runs"] == summary["buckets"]
    assert summary["first_launch_ms"] < summary["gradients_done_ms"]  # communication starts before backward ends


@pytest.mark.parametrize("script, args, names", [
    ("ch3_ddp_knobs.py", ["--batch-size", "0"], "--batch-size"),
    ("ch3_ddp_knobs.py", ["--precision-steps", "1"], "--precision-steps"),
    ("ch3_ddp_knobs.py", ["--experiments", "warp"], "--experiments"),
    ("ch3_overlap_benchmark.py", ["--bucket-cap-mb", "-1"], "--bucket-cap-mb"),
    ("ch3_overlap_benchmark.py", ["--backend", "nccl"], "--backend nccl"),
    ("ch3_profile_step.py", ["--warmup", "1"], "--warmup"),
])
def test_bad_input_gives_a_one_line_error(script, args, names):
    # GPUs hidden: on a GPU machine --backend nccl is valid, and the benchmark would just run.
    done = run_python(script, *args, check=False, timeout=120, env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode != 0
    assert "Traceback" not in done.output
    errors = [line for line in done.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and names in errors[0], done.output


def test_compile_without_a_cpp_compiler_says_so_in_one_line(tmp_path):
    """--compiler inductor needs g++ or clang++: with none on the PATH, one line names the way out."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)  # a PATH with Python and nothing else
    done = run_python("ch3_compile_ddp.py", "--compiler", "inductor", check=False, timeout=120,
                      env={"PATH": str(bare)})
    assert done.returncode == 2
    errors = [line for line in done.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and "use --compiler aot_eager" in errors[0], done.output
