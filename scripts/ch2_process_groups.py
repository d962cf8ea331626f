"""Processes, ranks and groups: how processes join a group, split it, wait for each other and leave.

    torchrun --standalone --nproc_per_node=4 scripts/ch2_process_groups.py
    torchrun --standalone --nproc_per_node=2 scripts/ch2_process_groups.py --init-method file:///tmp/ch2_rendezvous
    torchrun --standalone --nproc_per_node=2 scripts/ch2_process_groups.py --timeout-s 2 --late-rank 1

In order, every rank:
  1. joins the default group with init_process_group and --init-method: env:// reads RANK, WORLD_SIZE,
     MASTER_ADDR and MASTER_PORT (torchrun exports them); tcp://HOST:PORT and file:///PATH name a
     meeting point and take the rank and world size as arguments (here, from the same variables);
  2. splits the world into even and odd ranks with new_group, and all-reduces within its own group;
  3. arrives at a barrier at its own time, and leaves it when the last rank has arrived;
  4. starts an all_reduce with async_op=True, computes while it runs, and waits on the handle;
  5. leaves with destroy_process_group, and joins again through a TCPStore it creates itself.
With --late-rank R, rank R instead arrives --late-by-s seconds late at a barrier and the others give
up after --timeout-s seconds: the process-group timeout bounds every collective.
"""

import argparse
import datetime
import os
import time
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

from dtbook.cli import (
    ScriptError,
    add_backend_and_metrics,
    one_line,
    positive_float,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.comm_timing import synchronize
from dtbook.distributed import choose_backend, drain_gloo_workers, fill_in_launch_variables, open_metrics
from dtbook.ports import free_port


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--init-method", default="env://",
                        help="env:// (default), tcp://HOST:PORT or file:///ABSOLUTE/PATH (a file that "
                             "does not exist yet, on storage every process can reach)")
    parser.add_argument("--timeout-s", type=positive_float, default=60.0,
                        help="process-group timeout in seconds: a collective that cannot finish fails "
                             "after this long (default 60)")
    parser.add_argument("--late-rank", type=int, help="only show a timeout: this rank is late at a barrier")
    parser.add_argument("--late-by-s", type=positive_float, default=30.0,
                        help="how late --late-rank arrives (default 30 s)")
    parser.add_argument("--async-elements", type=positive_int, default=2**22,
                        help="float32 elements all-reduced during computation (default 4Mi = 16 MiB)")
    add_backend_and_metrics(parser)
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", 1))
    if world < 2:
        raise ScriptError("groups need company: run with 2 or more processes, "
                          "e.g. torchrun --standalone --nproc_per_node=4 scripts/ch2_process_groups.py")
    if not args.init_method.startswith(("env://", "tcp://", "file://")):
        raise ScriptError(f"--init-method {args.init_method!r}: use env://, tcp://HOST:PORT or file:///PATH")
    if args.init_method.startswith("tcp://"):
        check_tcp_address(args.init_method)
    if args.late_rank is not None and not 0 < args.late_rank < world:
        raise ScriptError(f"--late-rank must be between 1 and {world - 1}: rank 0 stays on time to report")
    if args.late_rank is not None and args.late_by_s <= args.timeout_s:
        raise ScriptError(f"--late-by-s {args.late_by_s:g} must exceed --timeout-s {args.timeout_s:g}, "
                          "or the late rank arrives in time")
    return args


def check_tcp_address(init_method: str) -> None:
    """Refuse a tcp:// address that no process would serve, before waiting for it in vain."""
    try:
        port = urlparse(init_method).port
    except ValueError:
        port = None
    if port is None:
        raise ScriptError(f"--init-method {init_method}: tcp:// needs HOST:PORT, with a port number")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and port != int(os.environ["MASTER_PORT"]):
        raise ScriptError(f"--init-method {init_method}: under torchrun every process connects to the "
                          f"store torchrun's agent serves, MASTER_ADDR:MASTER_PORT (port "
                          f"{os.environ['MASTER_PORT']}), and nobody would serve this port; use env:// "
                          "or file://")


def join(init_method: str, backend: str, device: torch.device,
         timeout: datetime.timedelta) -> float:
    """Join the default process group; return the seconds it took (all wait for
    all)."""
    start = time.perf_counter()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device_id = device if device.type == "cuda" else None  # NCCL: bind this GPU now
    # rank, size and address all come from the environment
    if init_method == "env://":
        dist.init_process_group(backend, init_method="env://", timeout=timeout,
                                device_id=device_id)
    else:  # tcp:// and file:// only say where to meet: rank and size are arguments
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world, timeout=timeout,
                                device_id=device_id)
    return time.perf_counter() - start


def even_and_odd_groups(device: torch.device) -> dict:
    """Split the world in two groups, all-reduce in each; return what this rank
    saw."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # Every rank creates every group, in the same order, even groups it is not in.
    evens = dist.new_group(list(range(0, world, 2)))
    odds = dist.new_group(list(range(1, world, 2)))
    mine, other = (evens, odds) if rank % 2 == 0 else (odds, evens)
    x = torch.tensor([float(rank)], device=device)
    dist.all_reduce(x, group=mine)  # only the members of `mine` take part
    return {"rank": rank, "group": "even" if mine is evens else "odd",
            "group_ranks": dist.get_process_group_ranks(mine),
            "rank_in_group": dist.get_rank(mine),
            "group_size": dist.get_world_size(mine),
            "rank_in_other_group": dist.get_rank(other), "group_sum": x.item()}


def barrier_arrivals() -> tuple[float, float]:
    """Arrive at a barrier 0.2 s after the previous rank; return (arrived, left) on the wall clock."""
    time.sleep(0.2 * dist.get_rank())
    arrived = time.time()  # wall-clock time: comparable between processes on one machine
    dist.barrier()
    return arrived, time.time()


def compute(a: torch.Tensor) -> torch.Tensor:
    """Some work that does not touch the tensor being reduced."""
    for _ in range(20):
        a = torch.tanh(a @ a)
    return a


def overlap_all_reduce(elements: int, device: torch.device) -> dict:
    """Start an all_reduce, compute while it runs, then wait: what async_op is
    for."""
    world = dist.get_world_size()
    a = torch.randn(256, 256, device=device)
    gradient = torch.ones(elements, device=device)

    start = time.perf_counter()
    work = dist.all_reduce(gradient, async_op=True)  # returns a Work handle at once
    returned = time.perf_counter() - start
    completed_at_return = work.is_completed()
    compute(a)
    # on a GPU, work is only queued until now: wait for it to run
    synchronize(device)
    computed = time.perf_counter() - start
    work.wait()  # now `gradient` holds the sum (a GPU's current stream waits for it)
    synchronize(device)
    finished = time.perf_counter() - start
    sum_correct = bool((gradient == world).all())

    start = time.perf_counter()  # for comparison: the same work, one after the other
    dist.all_reduce(torch.ones(elements, device=device))
    synchronize(device)
    blocking = time.perf_counter() - start
    compute(a)
    synchronize(device)
    one_after_the_other = time.perf_counter() - start

    # A handle's future can carry a continuation: DDP's communication hooks return
    # such.
    future = dist.all_reduce(torch.ones(4, device=device),
                             async_op=True).get_future()
    averaged = future.then(lambda done: done.value()[0] / world).wait()
    return {"returned_s": returned, "computed_s": computed, "finished_s": finished,
            "blocking_all_reduce_s": blocking,
            "one_after_the_other_s": one_after_the_other,
            "completed_at_return": completed_at_return,
            "completed_after_wait": work.is_completed(), "sum_correct": sum_correct,
            "future_average": averaged.tolist()}


def rejoin_with_own_store(backend: str, device: torch.device,
                          timeout: datetime.timedelta) -> dict:
    """Leave the default group, then join a new one through a TCPStore built by
    hand."""
    rank, world = dist.get_rank(), dist.get_world_size()
    port = [free_port() if rank == 0 else None]
    # agree on where to meet next, while we can
    dist.broadcast_object_list(port, src=0)
    drain_gloo_workers()
    dist.destroy_process_group()
    try:
        dist.barrier()
        after_destroy = "the barrier ran"
    except (RuntimeError, ValueError) as err:
        after_destroy = one_line(err)

    # The store is a key-value table every process reaches over TCP; rank 0 serves
    # it.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], port[0], world_size=world,
                          is_master=rank == 0, timeout=timeout)
    store.set(f"hello/{rank}", f"rank {rank} is process {os.getpid()}")
    # waits for the key
    neighbour = store.get(f"hello/{(rank + 1) % world}").decode()
    device_id = device if device.type == "cuda" else None
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timeout, device_id=device_id)
    x = torch.ones(1, device=device)
    dist.all_reduce(x)
    return {"port": port[0], "collective_after_destroy": after_destroy,
            "neighbour_says": neighbour, "all_reduce_after_rejoin": x.item()}


def late_barrier(late_rank: int, late_by_s: float) -> tuple[float, str | None]:
    """One rank arrives late; the others' barrier fails after the group's timeout.

    Returns the seconds this rank waited in the barrier and its error (None if it passed).
    """
    if dist.get_rank() == late_rank:
        time.sleep(late_by_s)
    start = time.perf_counter()
    try:
        dist.barrier()
        return time.perf_counter() - start, None
    except RuntimeError as err:  # gloo raises; NCCL's watchdog may end the process instead
        return time.perf_counter() - start, one_line(err)


def main() -> None:
    args = parse_args()
    fill_in_launch_variables()
    backend, device = choose_backend(args.backend)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    join_s = join(args.init_method, backend, device, timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    metrics.write(event="join", init_method=args.init_method, seconds=join_s, backend=dist.get_backend(),
                  backend_config=str(dist.get_backend_config()), timeout_s=args.timeout_s,
                  agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
                  default_timeout_s=default_pg_timeout.total_seconds(),
                  default_nccl_timeout_s=default_pg_nccl_timeout and default_pg_nccl_timeout.total_seconds())
    if rank == 0:
        print(f"{world} processes joined via {args.init_method} in {join_s:.2f} s; backend "
              f"{dist.get_backend()} ({dist.get_backend_config()})", flush=True)

    if args.late_rank is not None:
        waited, error = late_barrier(args.late_rank, args.late_by_s)
        metrics.write(event="timeout", waited_s=waited, error=error, late_rank=args.late_rank,
                      late_by_s=args.late_by_s, timeout_s=args.timeout_s)
        if error:  # this rank cannot go on: its group is broken
            raise ScriptError(f"barrier gave up after {waited:.1f} s (timeout {args.timeout_s:g} s): "
                              f"rank {args.late_rank} did not arrive; {error}")
        return

    groups = [None] * world
    dist.all_gather_object(groups, even_and_odd_groups(device))
    times = [None] * world
    dist.all_gather_object(times, barrier_arrivals())
    overlap = overlap_all_reduce(args.async_elements, device)
    rejoin = rejoin_with_own_store(backend, device, timeout)

    if rank == 0:
        for g in groups:
            print(f"rank {g['rank']}: {g['group']} group {g['group_ranks']}, rank {g['rank_in_group']} of "
                  f"{g['group_size']} in it (in the other group: {g['rank_in_other_group']}), "
                  f"group all_reduce -> {g['group_sum']:g}")
            metrics.write(event="group", **g)
        first = min(arrived for arrived, _ in times)
        for r, (arrived, left) in enumerate(times):
            print(f"rank {r}: arrived at the barrier at +{arrived - first:.3f} s, left at +{left - first:.3f} s")
            metrics.write(event="barrier", rank=r, arrived=arrived, left=left)
        print(f"async all_reduce of {args.async_elements * 4 / 2**20:g} MiB: call returned after "
              f"{overlap['returned_s'] * 1e3:.1f} ms, computation done at {overlap['computed_s'] * 1e3:.1f} ms, "
              f"wait() returned at {overlap['finished_s'] * 1e3:.1f} ms; completed at return: "
              f"{overlap['completed_at_return']}, after wait: {overlap['completed_after_wait']}")
        metrics.write(event="async", elements=args.async_elements, **overlap)
        print(f"after destroy_process_group a barrier says: {rejoin['collective_after_destroy']}")
        print(f"rejoined through a TCPStore on port {rejoin['port']}: the neighbour's key says "
              f"{rejoin['neighbour_says']!r}; all_reduce(1) = {rejoin['all_reduce_after_rejoin']:g}")
        metrics.write(event="rejoin", **rejoin)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
