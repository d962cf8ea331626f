"""Chapter 3, section 1: what the page cannot show, a world of one without a launcher and bad input.

The book's run of notebooks/ch3_ddp/01_how_ddp_works.ipynb asserts the minimal DDP against the real
one and one process, where DDP divides, the initial broadcast, the buckets launched during backward
and DDP's bucket layout; none of that is launched again here.
"""

import pytest

from dtbook.metrics import read_metrics
from support import run_python


def test_world_of_one_without_launcher(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run_python("ch3_minimal_ddp.py", "--model", "tiny", "--steps", 1, "--layout-caps-mb", 25, "--metrics", metrics,
               timeout=180)
    step = next(m for m in read_metrics(metrics) if m.get("event") == "gradients")
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
    errors = [line for line in done.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in done.output
