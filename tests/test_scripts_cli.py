"""Every companion script is a proper command-line program: --help, and one-line errors for bad input."""

import pytest
import torch

from support import SCRIPTS, run_python

PROGRAMS = sorted(p.name for p in SCRIPTS.glob("*.py") if p.name != "common.py")


@pytest.mark.parametrize("script", PROGRAMS)
def test_help(script):
    done = run_python(script, "--help", timeout=60)
    assert done.stdout.startswith("usage:")
    assert "--backend" in done.stdout and "--metrics" in done.stdout


@pytest.mark.parametrize("script", PROGRAMS)
def test_unknown_flag_is_rejected_in_one_line(script):
    done = run_python(script, "--no-such-flag", check=False, timeout=60)
    assert done.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, --backend nccl is a valid request")
@pytest.mark.parametrize("script", PROGRAMS)
def test_nccl_without_gpus_is_refused_in_one_line(script):
    done = run_python(script, "--backend", "nccl", check=False, timeout=120)
    assert done.returncode != 0
    assert "error:" in done.stderr and "nccl" in done.stderr
    assert "Traceback" not in done.stderr
