"""What torchrun tells each process: every rank reports its launch environment.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_torchrun_env.py
    # two "nodes" on one machine: run each line in its own terminal
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo scripts/ch3_torchrun_env.py
    torchrun --nnodes=2 --node_rank=1 --nproc_per_node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo scripts/ch3_torchrun_env.py

Each worker reads the variables its agent exported, joins the process group
with init_method="env://" (on a GPU with device_id, which binds the process to
its GPU), checks that the group agrees with the variables, and sends its
description to rank 0, which prints one line per process.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist

from dtbook.cli import ScriptError, add_backend_and_metrics, run_main, script_parser
from dtbook.distributed import choose_backend, drain_gloo_workers, fill_in_launch_variables, open_metrics

# The variables torchrun sets for every worker (TORCHELASTIC_* ones are collected too).
LAUNCH_VARIABLES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT"]


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add_backend_and_metrics(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # Read the environment before anything fills in defaults: what the launcher set.
    launched = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    launched.update({k: v for k, v in os.environ.items()
                     if k.startswith("TORCHELASTIC_")})
    fill_in_launch_variables()  # no torchrun: srun's task, or a world of one
    # On GPUs: device is cuda:LOCAL_RANK, and choose_backend has already called
    # torch.cuda.set_device(device), before init_process_group.
    backend, device = choose_backend(args.backend)
    # device_id binds the process to its GPU: NCCL creates its communicator right
    # here (a broken setup fails now, not in the first collective), barrier() knows
    # which GPU to use, and new_group() can split the communicator. It takes an
    # accelerator only; with gloo the process computes on the CPU and passes none.
    dist.init_process_group(backend=backend, init_method="env://",
                            device_id=device if device.type == "cuda" else None)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    told = f"{os.environ['RANK']}/{os.environ['WORLD_SIZE']}"
    if f"{rank}/{world_size}" != told:
        raise ScriptError(f"process group says rank {rank}/{world_size}, "
                          f"environment says {told}")

    bound = dist.group.WORLD.bound_device_id
    me = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
          "parent_pid": os.getppid(), "device": str(device),
          "bound_device_id": None if bound is None else str(bound), "env": launched}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, me)

    # One collective over the whole world: every process, on every node, takes part.
    total = torch.tensor([1.0], device=device)
    dist.all_reduce(total)
    if total.item() != world_size:
        raise ScriptError(f"all_reduce counted {total.item():g} processes, "
                          f"expected {world_size}")

    if rank == 0:
        metrics = open_metrics(args.metrics, backend, device)
        for who in everyone:
            metrics.write(event="process", **who)
        metrics.close()
        for who in everyone:
            env = who["env"]
            print(f"RANK={env['RANK']} LOCAL_RANK={env['LOCAL_RANK']} "
                  f"GROUP_RANK={env['GROUP_RANK']} WORLD_SIZE={env['WORLD_SIZE']} "
                  f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']} "
                  f"MASTER={env['MASTER_ADDR']}:{env['MASTER_PORT']} "
                  f"pid={who['pid']} agent={who['parent_pid']}")
        print(f"all_reduce over the world counted {total.item():g} processes")
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
