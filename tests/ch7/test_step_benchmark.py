"""Chapter 7, section 6: the step benchmark's naive loop averages gradients as DDP does.

Timings are not tested (the notebook shows them, with their spread); what is tested is that the
loop the benchmark compares DDP with computes the same thing, and that bad requests fail in one line.
"""

from dtbook.metrics import read_metrics
from support import run_in_process, run_torchrun

# The naive loop and DDP all-reduce the same gradients, one tensor at a time against flat buckets;
# gloo may sum in another order, so they can differ by float32 rounding of a two-term sum, a few
# epsilons (2**-23) of the largest gradient entry. 1e-5 of it leaves room for any CPU's rounding
# and is far below the control: a rank's own, never-averaged gradients differ from the mean by
# the order of the gradient itself (different batches per rank).
GRADIENT_TOLERANCE = 1e-5


def test_naive_loop_computes_ddps_gradients_and_the_control_does_not(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    run_torchrun("ch7_step_benchmark.py", "--model", "tiny", "--check-gradients",
                 "--steps", 2, "--warmup", 1, "--metrics", metrics, timeout=180)
    records = read_metrics(metrics)
    (grads,) = [r for r in records if r["event"] == "gradients"]
    assert grads["naive_relative_difference"] < GRADIENT_TOLERANCE
    assert grads["control_relative_difference"] > 1000 * GRADIENT_TOLERANCE
    (row,) = [r for r in records if r["event"] == "step"]
    # Every byte of gradient is in exactly one bucket.
    assert sum(row["bucket_bytes"]) == sum(row["tensor_bytes"])


def test_help_shows_the_definitions(monkeypatch, capsys):
    assert run_in_process("ch7_step_benchmark.py", "--help", monkeypatch=monkeypatch) == 0
    assert "exposed = (T - T_local) / T_comm" in capsys.readouterr().out


def test_gradient_check_on_one_process_is_refused_in_one_line(monkeypatch, capsys):
    code = run_in_process("ch7_step_benchmark.py", "--check-gradients", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --check-gradients") and len(err.splitlines()) == 1


def test_bucket_cap_must_be_positive(monkeypatch, capsys):
    code = run_in_process("ch7_step_benchmark.py", "--bucket-caps", "0", monkeypatch=monkeypatch)
    assert code == 2 and "must be a finite number greater than 0" in capsys.readouterr().err
