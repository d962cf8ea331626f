"""Backend choice and the world of one, in-process (no process group is created here)."""

import os

import pytest
import torch

from dtbook.cli import ScriptError
from dtbook.distributed import choose_backend, ddp_device_ids, use_single_process_defaults

NO_GPU = not torch.cuda.is_available()
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.skipif(not NO_GPU, reason="with a GPU, nccl is a valid request")
def test_nccl_without_gpus_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ScriptError, match=r"needs one CUDA GPU per local process: 2 process\(es\).*0 GPU"):
        choose_backend("nccl")


@pytest.mark.skipif(not NO_GPU, reason="auto picks nccl where GPUs exist")
def test_auto_means_gloo_on_the_cpu():
    assert choose_backend("auto") == ("gloo", torch.device("cpu"))


def test_an_unknown_backend_is_refused():
    with pytest.raises(ScriptError, match="unknown backend 'mpi'"):
        choose_backend("mpi")


def test_without_a_launcher_the_world_has_one_process(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        # setenv first, so that monkeypatch restores the variable's absence after the test: a RANK
        # leaking into this process would reach every script that the rest of the suite starts.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    use_single_process_defaults()

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536


def test_a_launchers_variables_are_left_alone(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    use_single_process_defaults()

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("3", "4")


def test_ddp_device_ids_are_none_on_the_cpu():
    assert ddp_device_ids(torch.device("cpu")) is None
    assert ddp_device_ids(torch.device("cuda", 1)) == [1]
