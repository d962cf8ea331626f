"""The same command gives the same weights: MKL's reproducible mode is on in every process, and repetition agrees.

See scripts/dtbook/reproducibility.py for the cause (MKL choosing GEMM code paths at run time) and
scripts/ch3_repeatability.py for the harness. Kill-and-resume bit-exactness is tested in test_train.py.
"""

import re

from dtbook.metrics import read_metrics
from support import run_python, run_torchrun

ONE_STEP = ["--model", "tiny", "--corpus-tokens", "5000", "--max-steps", "1", "--batch-size", "4"]


def cnr_modes(output: str) -> set[str]:
    """The reproducibility mode MKL reports on each GEMM it logs (MKL_VERBOSE=1)."""
    return set(re.findall(r"MKL_VERBOSE SGEMM.* CNR:(\S+)", output))


def test_every_worker_multiplies_in_mkls_reproducible_mode():
    """Started plainly by torchrun, with no MKL_CBWR in the environment, the workers set it themselves."""
    done = run_torchrun("ch3_train.py", *ONE_STEP, env={"MKL_VERBOSE": "1", "MKL_CBWR": None})
    assert cnr_modes(done.stdout) == {"AUTO,STRICT"}


def test_a_readers_own_setting_is_kept():
    """The control: MKL reports another mode when asked for one, so the test above can tell them apart."""
    done = run_python("ch3_train.py", *ONE_STEP, env={"MKL_VERBOSE": "1", "MKL_CBWR": "COMPATIBLE"})
    assert cnr_modes(done.stdout) == {"COMPATIBLE"}


def test_repeated_runs_give_one_result(tmp_path):
    """Three runs of one command, two processes each, dropout on: one weights hash."""
    metrics = tmp_path / "repeat.jsonl"
    run_python("ch3_repeatability.py", "--runs", 3, "--model", "tiny", "--max-steps", 6,
               "--metrics", metrics, timeout=600)
    result = [r for r in read_metrics(metrics) if r["event"] == "result"]
    assert [(r["check"], r["runs"], r["distinct"]) for r in result] == [("same command", 3, 1)]
    assert len({r["weights_sha256"] for r in read_metrics(metrics) if r["event"] == "run"}) == 1
