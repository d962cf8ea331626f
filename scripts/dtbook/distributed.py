"""Backend and device choice, and process-group set-up, the same way in every companion script.

``auto`` means NCCL with one GPU per local process where there are enough GPUs, else gloo on the
CPU. Run without a launcher, a script becomes a world of one, so ``python script.py`` works too;
started by Slurm's ``srun`` as one task per process, it takes its rank from Slurm's variables.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from dtbook.cli import ScriptError
from dtbook.metrics import MetricsWriter
from dtbook.ports import free_port
from dtbook.reproducibility import require_reproducible_cpu_math


def choose_backend(requested: str = "auto") -> tuple[str, torch.device]:
    """Pick the process-group backend and this process's device.

    Asking for ``nccl`` without enough GPUs is an error rather than a silent fallback: a run that
    says nccl must be nccl. gloo always computes on the CPU here. It also makes the CPU math of this
    process reproducible bit for bit (see dtbook.reproducibility), before anything multiplies a matrix.
    """
    require_reproducible_cpu_math()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    enough_gpus = gpus >= local_world_size

    if requested not in ("auto", "gloo", "nccl"):
        raise ScriptError(f"unknown backend {requested!r}: choose auto, gloo or nccl")
    if requested == "nccl" and not enough_gpus:
        raise ScriptError(
            f"--backend nccl needs one CUDA GPU per local process: {local_world_size} "
            f"process(es) on this node, {gpus} GPU(s) visible. Use --backend gloo (or auto) on CPU."
        )
    backend = requested if requested != "auto" else ("nccl" if gpus and enough_gpus else "gloo")
    if backend == "gloo":
        return backend, torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return backend, device


def fill_in_launch_variables() -> None:
    """Set the variables torchrun gives its workers, where torchrun did not start us.

    Started by torchrun, nothing changes. Started by Slurm's ``srun`` as one task per
    process, RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE come from Slurm's task
    variables (``slurm_task_variables``). Started alone (``python script.py``), the
    process is a world of one. Either way ``init_process_group`` works unchanged.
    """
    if "RANK" in os.environ:
        return
    if "SLURM_STEP_ID" in os.environ:  # a task of an srun job step
        os.environ.update(slurm_task_variables(os.environ))
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def slurm_task_variables(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for a process that ``srun`` started as a task of a step.

    srun numbers the step's tasks: SLURM_PROCID (0 to SLURM_NTASKS - 1) over all
    nodes, and SLURM_LOCALID on this node, whose tasks SLURM_GTIDS lists in that
    order. It names no meeting point: the job file exports MASTER_ADDR (the first
    host of the allocation, where rank 0 hosts the store) and MASTER_PORT. Variables
    that disagree are refused in one line: a guessed rank would hang, or train alone.
    """
    def number(name: str) -> int:
        value = env.get(name, "")
        if not value.isdigit():
            raise ScriptError(f"srun sets {name} for every task, but here it is "
                              f"{value or 'unset'}: start the program with srun")
        return int(value)

    rank, world = number("SLURM_PROCID"), number("SLURM_NTASKS")
    local_rank = number("SLURM_LOCALID")
    local_tasks = [t for t in env.get("SLURM_GTIDS", str(rank)).split(",") if t]
    if not rank < world:
        raise ScriptError(f"SLURM_PROCID {rank} is not a task of the {world} that "
                          "SLURM_NTASKS counts")
    if local_rank >= len(local_tasks) or local_tasks[local_rank] != str(rank):
        raise ScriptError(f"SLURM_PROCID {rank} with SLURM_LOCALID {local_rank} is "
                          "not one of this node's tasks (SLURM_GTIDS "
                          f"{','.join(local_tasks)})")
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
    if missing and world > 1:
        names, verb, them = (missing[0], "is", "it") if len(missing) == 1 else \
            (" and ".join(missing), "are", "them")
        raise ScriptError(f"srun started {world} tasks but {names} {verb} not set: "
                          f"export {them} in the job file (the first host of "
                          "SLURM_JOB_NODELIST, a free port)")
    meeting = {"MASTER_ADDR": env.get("MASTER_ADDR") or "127.0.0.1",
               "MASTER_PORT": env.get("MASTER_PORT") or str(free_port())}
    return {"RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(len(local_tasks)),
            **meeting}


def start_process_group(requested: str = "auto", timeout_s: float | None = None) -> tuple[str, torch.device]:
    """Choose backend and device, then join the process group that torchrun's variables describe.

    ``timeout_s`` bounds every collective: one that can never complete raises instead of hanging for
    the default 10 (NCCL) or 30 (gloo) minutes.
    """
    fill_in_launch_variables()
    backend, device = choose_backend(requested)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, init_method="env://", timeout=timeout,
                            device_id=process_group_device(device))
    return backend, device


def process_group_device(device: torch.device) -> torch.device | None:
    """``init_process_group``'s ``device_id``: this process's GPU, or None on the CPU.

    Bound to its GPU, NCCL creates the communicator at once and ``barrier()`` knows the device;
    without it NCCL warns "Guessing device ID based on global rank", which can hang where ranks
    and GPUs do not map one to one. The argument takes an accelerator only.
    """
    return device if device.type == "cuda" else None


def start_single_device(requested: str = "auto") -> tuple[str, torch.device]:
    """``start_process_group`` for a program that trains on one device: a world of one, or an error.

    Chapter 1's programs follow the book's conventions, so they run unchanged under
    ``torchrun --nproc_per_node=1``; started as several processes they would only repeat each other.
    """
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size != 1:
        raise ScriptError(f"this program trains on one device, but it was started as {world_size} "
                          "processes: use torchrun --nproc_per_node=1 or plain python")
    return start_process_group(requested)


def require_gpu_for(model: str, device: torch.device) -> None:
    """Refuse a GPU-only model size (dtbook.model.GPU_ONLY_SIZES) on the CPU, in one line."""
    from dtbook.model import GPU_ONLY_SIZES

    if model in GPU_ONLY_SIZES and device.type != "cuda":
        raise ScriptError(f"--model {model} is a GPU size: a step on this CPU would take minutes; "
                          "run it on a CUDA machine, or pick tiny, small, medium or large")


def drain_gloo_workers(seconds: float = 0.25) -> None:
    """Call right before ``dist.destroy_process_group()``: it avoids a hang at exit with gloo.

    Gloo runs collectives on worker threads. When one finishes, its thread frees the work, and
    with it the last reference to tensors Python created (``all_gather_object``'s buffers, a
    bucket view), which needs the GIL. ProcessGroupGloo's destructor joins those threads while
    holding the GIL (pytorch/pytorch#56297, open): if the last reference to the group goes (at
    ``destroy_process_group``, or when a DDP model's reducer is freed) before the threads are
    done, each waits for the other forever. Seen with torch 2.13 in about one run in five of
    ``ch4_zero1.py``: gdb shows the main thread in ``~ProcessGroupGloo`` / ``thread::join`` and
    a ``pt_gloo_runloop`` thread in ``~AsyncAllgatherWork`` / ``gil_scoped_acquire``. Sleeping
    releases the GIL, so the threads finish freeing first. NCCL does not run this way: no-op.
    """
    if dist.is_initialized() and dist.get_backend() == "gloo":
        time.sleep(seconds)


def ddp_device_ids(device: torch.device) -> list[int] | None:
    """DDP's ``device_ids``: this process's one GPU, or None for a CPU module."""
    return [device.index] if device.type == "cuda" else None


def device_name(device: torch.device) -> str:
    """A human-readable name of the hardware a number came from."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(backend: str, world_size: int, device: torch.device) -> dict:
    """Where a run's numbers came from, recorded beside the numbers."""
    return {
        "event": "provenance",
        "backend": backend,
        "world_size": world_size,
        "device": device.type,
        "device_name": device_name(device),
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
    }


def open_metrics(path: str | Path | None, backend: str, device: torch.device) -> MetricsWriter:
    """Rank 0's metrics file, its first record the run's provenance (other ranks get a no-op writer)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = MetricsWriter(path, enabled=rank == 0)
    metrics.write(**provenance(backend, world_size, device))
    return metrics
