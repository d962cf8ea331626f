"""Hang a small job on purpose and leave the evidence: a flight-recorder dump per rank.

    export TORCH_FR_DUMP_TEMP_FILE=runs/fr/rank_
    torchrun --standalone --nproc_per_node=2 scripts/ch3_hang_forensics.py --extra-on-rank 0
    torchrun ... --extra-on-rank 0 --timeout 20    # 20 s to run py-spy dump on every rank
    torchrun ... --dump-at-end                     # the control: no hang, dumps all the same
    torchfrtrace runs/fr                           # torch's analyser reads the dumps

Every rank all-reduces a gradient-sized tensor for --steps steps, then meets the
others at a closing barrier. With --extra-on-rank R, rank R also all-reduces its
loss before the barrier, as a logging line inside `if rank == 0:` would: a
collective that no other rank issues. It waits for partners that wait at the
barrier, and every rank hangs until the process-group timeout (--timeout).

The flight recorder is on by default, on gloo as on NCCL: every rank keeps its
last 2000 collectives (op, sizes, sequence number and the Python stack that
issued it); TORCH_FR_BUFFER_SIZE changes the count, and 0 turns it off.
NCCL's watchdog writes that buffer out by itself when a collective times out;
gloo has no such watchdog, so here each rank writes it when its collective fails,
to TORCH_FR_DUMP_TEMP_FILE followed by its rank (torch's default prefix is
/tmp/nccl_trace_rank_), prints one line, and exits with status 2 two seconds
later, so that torchrun does not stop its partners before they write theirs.
Rank 0 writes the ranks' process ids to --metrics first, so a notebook can
attach `py-spy dump --pid` to each rank while it waits.
"""

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace

from dtbook.cli import (
    ScriptError,
    add_backend_and_metrics,
    one_line,
    positive_float,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group

# Where torch's DebugInfoWriter puts a dump when TORCH_FR_DUMP_TEMP_FILE is unset.
DEFAULT_DUMP_PREFIX = "/tmp/nccl_trace_rank_"
# After its dump and its line, a failed rank stays this long: torchrun stops every
# worker once one exits, and the partners, whose collectives fail moments later,
# must write theirs first. NCCL's watchdog waits likewise before it aborts
# (TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC).
DUMP_GRACE_S = 2.0
GRADIENT_NUMEL = 1024
# The flight recorder's size, under its current name and its older one: recorded as each run saw them.
BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
# prctl(2)'s option that names who may trace this process where Yama restricts it.
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--steps", type=positive_int, default=3,
        help="steps of one gradient all-reduce each before the end (default: 3)")
    add("--extra-on-rank", type=int,
        help="this rank all-reduces its loss before the closing barrier and no other "
             "rank does: the hang (default: none, every rank matches)")
    add("--timeout", type=positive_float, default=3.0,
        help="process-group timeout in seconds: how long the ranks hang (default: 3)")
    add("--dump-at-end", action="store_true",
        help="write the flight-recorder dump when the run ends well too (a control)")
    add_backend_and_metrics(parser)
    return parser.parse_args()


def check_inputs(args, world_size: int) -> None:
    """Refuse, before init_process_group, what cannot give a useful dump."""
    # torch reads the first of these that is set; unset, it keeps 2000 entries
    # (FlightRecorder.hpp, shipped in torch/include/torch/csrc/distributed/c10d).
    for name in BUFFER_VARIABLES:
        size = os.environ.get(name)
        if size is None:
            continue
        if not size.isdigit() or int(size) < 1:
            raise ScriptError(f"{name}={size!r} turns the flight recorder off or is "
                              f"no count: unset it (torch keeps 2000 collectives per "
                              f"rank) or give a positive number")
        break
    if args.extra_on_rank is None:
        return
    if world_size < 2:
        raise ScriptError("--extra-on-rank needs at least 2 processes "
                          "(torchrun --nproc_per_node=2)")
    if not 0 <= args.extra_on_rank < world_size:
        raise ScriptError(f"--extra-on-rank {args.extra_on_rank} is not a rank of this "
                          f"world of {world_size}")


def dump_path(rank: int) -> Path:
    """The file name torch's own writer uses: the prefix, then the rank."""
    return Path(os.environ.get("TORCH_FR_DUMP_TEMP_FILE", DEFAULT_DUMP_PREFIX) + str(rank))


def write_flight_record(rank: int) -> Path:
    """This rank's flight-recorder buffer, pickled as NCCL's watchdog writes it."""
    path = dump_path(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_dump_fr_trace())
    return path


def allow_py_spy() -> int | str:
    """Let py-spy, run by this user from any shell, read this process.

    Where Yama's ptrace_scope is 1 (Ubuntu's default), only a process's ancestors
    may trace it, and py-spy started from a notebook or a second shell is none of
    them. On Linux returns 0, or the errno: EINVAL without Yama, where nothing is
    needed. At scope 2 only root may trace (sudo py-spy), at 3 nobody. Elsewhere
    (macOS has neither Yama nor prctl; py-spy needs root there) it calls nothing
    and returns the reason in one line.
    """
    if not sys.platform.startswith("linux"):
        return (f"no prctl on {sys.platform}: nothing to allow, "
                "py-spy needs root here")
    libc = ctypes.CDLL(None, use_errno=True)
    done = libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)
    return 0 if done == 0 else ctypes.get_errno()


def share_pids(metrics) -> None:
    """Rank 0 records every rank's process id, what `py-spy dump --pid` needs, with
    what allow_py_spy answered and the recorder's size variables as this rank saw them."""
    ptracer = allow_py_spy()
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    metrics.write(event="pids", pids=pids, ptracer=ptracer,
                  buffer_env={name: os.environ.get(name) for name in BUFFER_VARIABLES},
                  unix_time=time.time())


def train_steps(steps: int, device: torch.device) -> torch.Tensor:
    """Stands in for training: one all-reduce of the gradients per step."""
    gradients = torch.ones(GRADIENT_NUMEL, device=device)
    for _ in range(steps):
        dist.all_reduce(gradients)
    return gradients.mean().reshape(1)


def log_final_loss(loss: torch.Tensor) -> None:
    """The bug: a collective that one rank issues and the others skip."""
    dist.all_reduce(loss)
    print(f"mean loss {loss.item() / dist.get_world_size():.3f}", flush=True)


def finish() -> None:
    """Every rank waits here for the others before it tears the group down."""
    dist.barrier()


def main() -> None:
    args = parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_inputs(args, world_size)
    backend, device = start_process_group(args.backend, timeout_s=args.timeout)
    rank = dist.get_rank()
    metrics = open_metrics(args.metrics, backend, device)
    share_pids(metrics)
    try:
        loss = train_steps(args.steps, device)
        metrics.write(event="diverging", extra_on_rank=args.extra_on_rank,
                      unix_time=time.time())
        if rank == args.extra_on_rank:
            log_final_loss(loss)
        finish()
    except RuntimeError as err:
        # A timeout, or a partner that timed out first and is gone: the evidence
        # goes to disk before this process does.
        path = write_flight_record(rank)
        raise ScriptError(f"{one_line(err)}; flight-recorder dump in {path}",
                          linger_s=DUMP_GRACE_S) from None
    if args.dump_at_end:
        write_flight_record(rank)
    metrics.write(event="done", unix_time=time.time())
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
