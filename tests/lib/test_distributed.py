"""Backend choice and the world of one, in-process (no process group is created here)."""

import os

import pytest
import torch
import torch.distributed as dist

from dtbook.cli import ScriptError
from dtbook.distributed import (
    choose_backend,
    ddp_device_ids,
    fill_in_launch_variables,
    require_gpu_for,
    start_process_group,
)

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has N GPUs, so the CUDA branches run on any machine (with or without)."""
    chosen = []

    def pretend(count: int, local_rank: int = 0, local_world_size: int = 1):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
        return chosen

    return pretend


def test_nccl_without_gpus_is_refused_with_the_reason(gpus):
    gpus(0, local_world_size=2)
    with pytest.raises(ScriptError, match=r"needs one CUDA GPU per local process: 2 process\(es\).*0 GPU"):
        choose_backend("nccl")


def test_nccl_with_fewer_gpus_than_local_processes_is_refused(gpus):
    gpus(1, local_world_size=2)  # two ranks on one GPU: NCCL would refuse the duplicate device
    with pytest.raises(ScriptError, match=r"2 process\(es\) on this node, 1 GPU"):
        choose_backend("nccl")


def test_auto_means_gloo_on_the_cpu(gpus):
    gpus(0)
    assert choose_backend("auto") == ("gloo", torch.device("cpu"))


def test_auto_means_gloo_where_the_local_ranks_outnumber_the_gpus(gpus):
    chosen = gpus(1, local_rank=1, local_world_size=2)
    assert choose_backend("auto") == ("gloo", torch.device("cpu"))
    assert chosen == []  # no GPU claimed


def test_auto_means_nccl_and_the_local_ranks_gpu_where_every_rank_has_one(gpus):
    chosen = gpus(4, local_rank=3, local_world_size=4)
    assert choose_backend("auto") == ("nccl", torch.device("cuda", 3))
    assert chosen == [torch.device("cuda", 3)]


def test_gloo_is_kept_on_a_gpu_machine_when_asked_for(gpus):
    chosen = gpus(2)
    assert choose_backend("gloo") == ("gloo", torch.device("cpu"))
    assert chosen == []


def test_the_process_group_is_bound_to_the_gpu_and_to_nothing_on_the_cpu(gpus, monkeypatch):
    """device_id: without it NCCL guesses the device from the global rank, and says so."""
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setenv("RANK", "5")  # a launcher's variables: no world of one filled in
    gpus(2, local_rank=1, local_world_size=2)
    assert start_process_group("auto") == ("nccl", torch.device("cuda", 1))
    gpus(0)
    assert start_process_group("auto") == ("gloo", torch.device("cpu"))
    assert [c["backend"] for c in calls] == ["nccl", "gloo"]
    assert [c["device_id"] for c in calls] == [torch.device("cuda", 1), None]


def test_an_unknown_backend_is_refused():
    with pytest.raises(ScriptError, match="unknown backend 'mpi'"):
        choose_backend("mpi")


def test_without_a_launcher_the_world_has_one_process(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        # setenv first, so that monkeypatch restores the variable's absence after the test: a RANK
        # leaking into this process would reach every script that the rest of the suite starts.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    fill_in_launch_variables()

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536


def test_a_launchers_variables_are_left_alone(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    fill_in_launch_variables()

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("3", "4")


def test_ddp_device_ids_are_none_on_the_cpu():
    assert ddp_device_ids(torch.device("cpu")) is None
    assert ddp_device_ids(torch.device("cuda", 1)) == [1]


def test_a_gpu_size_is_refused_on_the_cpu_and_accepted_on_a_gpu():
    with pytest.raises(ScriptError, match="--model gpt2-small is a GPU size"):
        require_gpu_for("gpt2-small", torch.device("cpu"))
    require_gpu_for("gpt2-small", torch.device("cuda", 0))
    require_gpu_for("large", torch.device("cpu"))
