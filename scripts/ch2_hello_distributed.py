"""Your first distributed program: every process says who it is, then they
all-reduce.

    torchrun --standalone --nproc_per_node=2 scripts/ch2_hello_distributed.py
    python scripts/ch2_hello_distributed.py          # a world of one, no launcher

Each rank contributes (rank + 1) to a SUM all-reduce, so every rank must end
with 1 + 2 + ... + world_size = world_size * (world_size + 1) / 2.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist

from dtbook.cli import ScriptError, add_backend_and_metrics, run_main, script_parser
from dtbook.distributed import (
    choose_backend,
    drain_gloo_workers,
    fill_in_launch_variables,
    open_metrics,
    process_group_device,
)


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add_backend_and_metrics(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    fill_in_launch_variables()
    backend, device = choose_backend(args.backend)

    # torchrun exported RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; "env://"
    # reads them.
    dist.init_process_group(backend=backend, init_method="env://",
                            device_id=process_group_device(device))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    print(f"rank {rank}/{world_size} (local rank {local_rank}) "
          f"on {socket.gethostname()}: backend={backend} device={device}",
          flush=True)

    # Every rank gathers every rank's self-description, so rank 0 can record them
    # all.
    me = {"rank": rank, "world_size": world_size, "local_rank": local_rank,
          "backend": backend, "device": str(device), "host": socket.gethostname(),
          "pid": os.getpid()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, me)

    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    expected = world_size * (world_size + 1) / 2
    if value.item() != expected:
        raise ScriptError(f"all_reduce gave {value.item()}, expected {expected}")

    if rank == 0:
        metrics = open_metrics(args.metrics, backend, device)
        for who in everyone:
            metrics.write(event="rank", **who)
        metrics.write(event="all_reduce", op="sum", contributed="rank + 1",
                      result=value.item(), expected=expected)
        metrics.close()
        print(f"all_reduce(SUM of rank+1) = {value.item():g} on every rank; "
              f"formula gives {expected:g}")
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
