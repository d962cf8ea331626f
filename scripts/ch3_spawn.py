"""The other launcher: torch.multiprocessing.spawn starts the workers from Python.

    python scripts/ch3_spawn.py --nproc 2

No torchrun here. The parent process picks a free port, then mp.spawn starts
``--nproc`` copies of ``worker`` and passes each its index as the first
argument. Nothing sets RANK, LOCAL_RANK or WORLD_SIZE: the worker is told its
rank as a function argument and hands rank, world size and the rendezvous
address to init_process_group itself. Each worker records which launcher
variables it found, and they all-reduce once to prove the group works.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.distributed import choose_backend, drain_gloo_workers, open_metrics
from dtbook.ports import free_port

LAUNCH_VARIABLES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]


def worker(rank: int, world_size: int, port: int, backend_request: str,
           metrics_path: str | None) -> None:
    """Runs in each spawned process; mp.spawn supplies ``rank`` (0 .. nprocs-1)."""
    found = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    # choose_backend picks the GPU from LOCAL_RANK, which only a launcher would set.
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    backend, device = choose_backend(backend_request)

    # No environment to read: rank, world size and the meeting point are explicit.
    dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {"rank": dist.get_rank(), "pid": os.getpid(),
                                      "parent_pid": os.getppid(), "env_found": found,
                                      "all_reduce": value.item()})
    if rank == 0:
        metrics = open_metrics(metrics_path, backend, device)
        for who in everyone:
            metrics.write(event="process", **who)
        metrics.write(event="all_reduce", result=value.item(),
                      expected=world_size * (world_size + 1) / 2)
        metrics.close()
        for who in everyone:
            unset = [name for name, got in who["env_found"].items() if got is None]
            print(f"spawned rank {who['rank']}: pid {who['pid']}, "
                  f"parent {who['parent_pid']}, "
                  f"launcher variables not set: {', '.join(unset) or 'none'}")
        print(f"all_reduce(SUM of rank+1) = {value.item():g}")
    drain_gloo_workers()
    dist.destroy_process_group()


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--nproc", type=positive_int, default=2, help="processes to spawn (default: 2)")
    add_backend_and_metrics(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:
        raise ScriptError("this script starts its own processes: run it with python, not torchrun")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.backend == "nccl" and gpus < args.nproc:
        # Checked here, in the parent, so the reader gets one line rather than one traceback per worker.
        raise ScriptError(f"--backend nccl needs one CUDA GPU per process: --nproc {args.nproc}, {gpus} GPU(s) "
                          "visible. Use --backend gloo (or auto) on CPU.")
    port = free_port()
    print(f"parent pid {os.getpid()}: spawning {args.nproc} workers, rendezvous at tcp://127.0.0.1:{port}",
          flush=True)
    # join=True waits for all workers and re-raises the first failure here, in the parent.
    mp.spawn(worker, args=(args.nproc, port, args.backend, args.metrics), nprocs=args.nproc, join=True)


if __name__ == "__main__":  # required: spawned children import this file, and must not spawn again
    run_main(main)
