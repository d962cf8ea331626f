"""Plain PyTorch under srun: Slurm's task variables become torchrun's, or one line says why not.

Section 5.3 submits scripts/slurm/ch3_train_srun.sbatch on the lab's two nodes, one task each, and
asserts the weights of a torchrun job. Here, without Slurm: the mapping for other layouts (several
tasks per node), its refusals of inconsistent variables, and the order of precedence: torchrun's
variables first, then an srun step's, then a world of one.
"""

import os

import pytest

from dtbook.cli import ScriptError
from dtbook.distributed import fill_in_launch_variables, slurm_task_variables
from support import LAUNCHER_VARIABLES, run_in_process

# Task 5 of 8 on the second of two nodes, 4 tasks each (block distribution): what srun sets.
TASK_5_OF_8 = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
               "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_GTIDS": "4,5,6,7",
               "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


def test_a_task_becomes_a_rank():
    assert slurm_task_variables(TASK_5_OF_8) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


def test_one_task_needs_no_meeting_point():
    alone = {"SLURM_STEP_ID": "3", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
             "SLURM_GTIDS": "0"}
    mapped = slurm_task_variables(alone)
    assert (mapped["RANK"], mapped["WORLD_SIZE"], mapped["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")


@pytest.mark.parametrize("change, problem", [
    ({"SLURM_PROCID": None}, "srun sets SLURM_PROCID for every task, but here it is unset"),
    ({"SLURM_NTASKS": "eight"}, "srun sets SLURM_NTASKS for every task, but here it is eight"),
    ({"SLURM_PROCID": "8"}, "SLURM_PROCID 8 is not a task of the 8 that SLURM_NTASKS counts"),
    ({"SLURM_LOCALID": "2"}, "SLURM_PROCID 5 with SLURM_LOCALID 2 is not one of this node's tasks"),
    ({"SLURM_GTIDS": "0,1,2,3"}, "is not one of this node's tasks"),
    ({"MASTER_ADDR": None}, "srun started 8 tasks but MASTER_ADDR is not set: export it"),
    ({"MASTER_ADDR": None, "MASTER_PORT": None}, "MASTER_ADDR and MASTER_PORT are not set"),
])
def test_inconsistent_variables_are_refused_in_one_line(change, problem):
    env = {k: v for k, v in {**TASK_5_OF_8, **change}.items() if v is not None}
    with pytest.raises(ScriptError, match=problem) as refused:
        slurm_task_variables(env)
    assert "\n" not in str(refused.value)


@pytest.fixture
def clean_environment(monkeypatch):
    """No launcher's and no Slurm's variables; monkeypatch restores them afterwards."""
    for name in (*LAUNCHER_VARIABLES, *(n for n in os.environ if n.startswith("SLURM_"))):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_torchrun_first_then_an_srun_step_then_a_world_of_one(clean_environment):
    monkeypatch = clean_environment
    # torchrun inside an srun task (ch3_train.sbatch): the worker keeps torchrun's rank.
    for name, value in {**TASK_5_OF_8, "RANK": "2", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    fill_in_launch_variables()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("2", "4")
    # No torchrun: the srun step's numbering.
    monkeypatch.delenv("RANK")
    fill_in_launch_variables()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")
    # A batch script's shell, or a login node, is no job step: a world of one.
    for name in ("RANK", "SLURM_STEP_ID"):
        monkeypatch.delenv(name)
    fill_in_launch_variables()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1")


def test_a_script_under_srun_without_master_addr_stops_in_one_line(clean_environment, capsys):
    monkeypatch = clean_environment
    for name, value in TASK_5_OF_8.items():
        if not name.startswith("MASTER_"):
            monkeypatch.setenv(name, value)
    code = run_in_process("ch3_train.py", "--model", "tiny", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: srun started 8 tasks but MASTER_ADDR and MASTER_PORT are not set")
