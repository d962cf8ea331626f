"""Every collective of torch.distributed on small tensors: what each rank holds before and after.

    torchrun --standalone --nproc_per_node=4 scripts/ch2_collectives.py
    torchrun --standalone --nproc_per_node=4 scripts/ch2_collectives.py --only all_reduce_sum all_to_all_single
    torchrun --standalone --nproc_per_node=2 scripts/ch2_collectives.py --who-uses

Rank r starts from the values 10r, 10r+1, 10r+2, ... so each number tells where it came from: its tens
digit is the rank that contributed it, and a reduced value is a mix. For each demonstration, every
rank's tensors before and after the call are gathered to rank 0, printed as a grid with one row per
rank, and written to --metrics. Then the script tries three operations that not every backend has,
prints the error this backend gives and runs the fallback; with --who-uses it also profiles a DDP
and an FSDP2 training step and lists the collectives each phase called.
"""

import argparse
import os
import warnings
from collections import Counter

import torch
import torch.distributed as dist

from dtbook.cli import ScriptError, add_backend_and_metrics, one_line, run_main, script_parser
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group


def values(rank: int, count: int, device) -> torch.Tensor:
    """10*rank, 10*rank + 1, ...: each value names the rank it started on."""
    return torch.arange(count, dtype=torch.float32, device=device) + 10 * rank


# --- one function per demonstration: it returns this rank's (before, after) -------------------

def broadcast(rank, world, device):
    x = values(rank, 4, device)
    before = x.tolist()
    dist.broadcast(x, src=0)  # every rank ends with rank 0's tensor
    return before, x.tolist()


def reduce(rank, world, device):
    x = values(rank, 4, device)
    before = x.tolist()
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)  # only rank 0's result is defined
    return before, x.tolist()


def all_reduce_sum(rank, world, device):
    x = values(rank, 4, device)
    before = x.tolist()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return before, x.tolist()


def all_reduce_avg(rank, world, device):
    x = values(rank, 4, device)
    before = x.tolist()
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    return before, x.tolist()


def all_reduce_max(rank, world, device):
    x = values(rank, 4, device)
    before = x.tolist()
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return before, x.tolist()


def gather(rank, world, device):
    x = values(rank, 2, device)
    pieces = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
    dist.gather(x, pieces, dst=0)  # only the destination passes (and gets) the list
    return x.tolist(), torch.cat(pieces).tolist() if rank == 0 else None


def all_gather(rank, world, device):
    x = values(rank, 2, device)
    pieces = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(pieces, x)
    return x.tolist(), torch.cat(pieces).tolist()


def all_gather_single(rank, world, device):
    x = values(rank, 2, device)
    out = torch.empty(world * x.numel(), device=device)
    dist.all_gather_single(out, x)  # into one tensor, no list: what FSDP2 uses
    return x.tolist(), out.tolist()


def scatter(rank, world, device):
    out = torch.empty(2, device=device)
    pieces = [values(r, 2, device) for r in range(world)] if rank == 0 else None
    dist.scatter(out, pieces, src=0)  # rank r receives pieces[r]
    return torch.cat(pieces).tolist() if rank == 0 else None, out.tolist()


def reduce_scatter(rank, world, device):
    x = values(rank, 2 * world, device)
    out = torch.empty(2, device=device)
    dist.reduce_scatter(out, list(x.chunk(world)), op=dist.ReduceOp.SUM)
    return x.tolist(), out.tolist()


def reduce_scatter_single(rank, world, device):
    x = values(rank, 2 * world, device)
    out = torch.empty(2, device=device)
    dist.reduce_scatter_single(out, x, op=dist.ReduceOp.SUM)  # rank r keeps chunk r
    return x.tolist(), out.tolist()


def all_to_all(rank, world, device):
    x = values(rank, world, device)
    received = [torch.empty(1, device=device) for _ in range(world)]
    dist.all_to_all(received, list(x.chunk(world)))  # piece j goes to rank j
    return x.tolist(), torch.cat(received).tolist()


def all_to_all_single(rank, world, device):
    x = values(rank, world, device)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    return x.tolist(), out.tolist()


def send_recv(rank, world, device):
    x, received = values(rank, 2, device), torch.empty(2, device=device)
    right, left = (rank + 1) % world, (rank - 1) % world
    if rank % 2 == 0:  # send and recv block: half the ranks send first, half receive
        dist.send(x, dst=right)
        dist.recv(received, src=left)
    else:
        dist.recv(received, src=left)
        dist.send(x, dst=right)
    return x.tolist(), received.tolist()


def isend_irecv(rank, world, device):
    x, received = values(rank, 2, device), torch.empty(2, device=device)
    right, left = (rank + 1) % world, (rank - 1) % world
    # no waiting
    requests = [dist.isend(x, dst=right), dist.irecv(received, src=left)]
    for request in requests:
        request.wait()  # x must not change, nor received be read, before this
    return x.tolist(), received.tolist()


def config_as_tensor(rank, world, device):
    """The config squeezed into a float32 tensor: numbers only, and rounded."""
    config = {"lr": 3e-4, "batch_size": 32, "seed": 123456789}
    packed = torch.tensor(list(config.values()) if rank == 0 else [0.0] * 3, device=device)
    dist.broadcast(packed, src=0)
    return list(config.values()) if rank == 0 else None, packed.tolist()


def config_as_object(rank, world, device):
    """The config as a Python object: pickled on rank 0, unpickled everywhere
    else."""
    config = [{"lr": 3e-4, "batch_size": 32, "seed": 123456789, "model": "small"}]
    if rank != 0:
        config = [None]
    dist.broadcast_object_list(config, src=0)
    return None if rank else repr(config[0]), repr(config[0])


DEMOS = [broadcast, reduce, all_reduce_sum, all_reduce_avg, all_reduce_max, gather, all_gather,
         all_gather_single, scatter, reduce_scatter, reduce_scatter_single, all_to_all, all_to_all_single,
         send_recv, isend_irecv, config_as_tensor, config_as_object]


# --- what a backend may lack, and the fallback ----------------------------------------------

def premul_sum(rank, world, device):
    """A sum that pre-scales each input: FSDP2 uses it for a custom gradient divide factor.

    (torch 2.13's _get_gradient_divide_factors: AVG for fp32 and bf16, PREMUL_SUM only when
    set_gradient_divide_factor differs from the group's size, SUM with ~sqrt(N) pre- and
    post-division for fp16.)
    """
    x = values(rank, 2, device)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(1 / world))  # private: FSDP's own op
    return x.tolist()


def premul_sum_fallback(rank, world, device):
    x = values(rank, 2, device)
    x.mul_(1 / world)  # the same pre-scaling, then a plain SUM
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x.tolist()


def uneven_all_gather(rank, world, device):
    """Rank r contributes r + 1 values."""
    x = values(rank, rank + 1, device)
    pieces = [torch.empty(r + 1, device=device) for r in range(world)]
    dist.all_gather(pieces, x)
    return torch.cat(pieces).tolist()


def uneven_all_gather_fallback(rank, world, device):
    x = values(rank, rank + 1, device)
    lengths = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([x.numel()], device=device))
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, device=device)
    padded[: x.numel()] = x
    pieces = [torch.empty(longest, device=device) for _ in range(world)]
    # equal sizes, then cut each piece back to its length
    dist.all_gather(pieces, padded)
    return torch.cat([p[: int(n)]
                      for p, n in zip(pieces, lengths, strict=True)]).tolist()


def integer_average(rank, world, device):
    x = torch.arange(2, device=device) + 10 * rank  # int64
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    return x.tolist()


def integer_average_fallback(rank, world, device):
    x = (torch.arange(2, device=device) + 10 * rank).double()  # the mean of integers is a float
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    return x.tolist()


PROBES = [(premul_sum, premul_sum_fallback), (uneven_all_gather, uneven_all_gather_fallback),
          (integer_average, integer_average_fallback)]


def deprecated_names(device) -> dict:
    """The warnings that the pre-2.13 names of the single-tensor collectives give."""
    world = dist.get_world_size()
    shard, full = torch.zeros(2, device=device), torch.zeros(2 * world, device=device)
    messages = {}
    for name, call in (("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(full, shard)),
                       ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(shard, full))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        messages[name] = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    return messages


# --- which collectives DDP and FSDP2 call ---------------------------------------------------

def collectives_by_phase(device) -> dict:
    """Profile a DDP and an FSDP2 step of a two-layer model; count collectives in each phase.

    ``c10d::`` events are what the framework asked the process group for; ``gloo:`` and
    ``nccl:`` events are what the backend ran.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import profile, record_function

    def two_layers():
        torch.manual_seed(0)  # the same weights on every rank
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).to(device)

    x = torch.randn(4, 8, device=device)
    ddp_model, fsdp_model = two_layers(), two_layers()
    with profile() as prof:
        with record_function("phase:DDP(model)"):
            ddp_model = DDP(ddp_model, device_ids=[device.index] if device.type == "cuda" else None)
        with record_function("phase:DDP forward+backward"):
            ddp_model(x).sum().backward()
        with record_function("phase:fully_shard(each layer, model)"):
            for layer in fsdp_model:
                fully_shard(layer)
            fully_shard(fsdp_model)
        with record_function("phase:FSDP forward"):
            loss = fsdp_model(x).sum()
        with record_function("phase:FSDP backward"):
            loss.backward()
    events = prof.events()
    phases = {e.name.removeprefix("phase:"): e.time_range for e in events if e.name.startswith("phase:")}
    counts = {name: Counter() for name in phases}
    for e in events:
        if e.name.startswith(("c10d::", "gloo:", "nccl:")):
            for name, span in phases.items():
                if span.start <= e.time_range.start <= span.end:
                    counts[name][e.name] += 1
    return {name: dict(c) for name, c in counts.items()}


# --- the program ------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--only", nargs="+", choices=[d.__name__ for d in DEMOS], metavar="NAME",
                        help="run only these demonstrations (default: all): "
                             + ", ".join(d.__name__ for d in DEMOS))
    parser.add_argument("--who-uses", action="store_true",
                        help="also profile a DDP and an FSDP2 step and list the collectives they call")
    add_backend_and_metrics(parser)
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", 1)) < 2:
        raise ScriptError("collectives need company: run with at least 2 processes, "
                          "e.g. torchrun --standalone --nproc_per_node=4 scripts/ch2_collectives.py")
    return args


def grid(rows: list) -> str:
    """One line per rank: its values, '-' if it holds none, or the text of an object."""
    lines = []
    for rank, row in enumerate(rows):
        if row is None:
            shown = "-"
        elif isinstance(row, list):
            shown = " ".join(f"{value:>5g}" for value in row)
        else:
            shown = row
        lines.append(f"    rank {rank}: {shown}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)

    for demo in DEMOS if args.only is None else [d for d in DEMOS if d.__name__ in args.only]:
        before, after = demo(rank, world, device)
        everyone = [None] * world
        dist.all_gather_object(everyone, (before, after))
        if rank == 0:
            befores, afters = zip(*everyone, strict=True)
            print(f"{demo.__name__}\n  before:\n{grid(befores)}\n  after:\n{grid(afters)}", flush=True)
            metrics.write(event="demo", name=demo.__name__, world_size=world,
                          before=list(befores), after=list(afters))

    for probe, fallback in PROBES:
        try:
            result, error = probe(rank, world, device), None
        except (RuntimeError, ValueError) as err:  # raised on every rank before anything is sent
            result, error = None, one_line(err)
        fallback_result = fallback(rank, world, device)
        if rank == 0:
            print(f"{probe.__name__} on {backend}: " + (f"refused: {error}" if error else f"ok: {result}")
                  + f"\n  fallback {fallback.__name__}: {fallback_result}", flush=True)
            metrics.write(event="probe", name=probe.__name__, backend=backend, error=error, result=result,
                          fallback=fallback.__name__, fallback_result=fallback_result)

    messages = deprecated_names(device)
    if rank == 0:
        for name, caught in messages.items():
            print(f"{name}: {caught[0] if caught else 'no deprecation warning'}")
        metrics.write(event="deprecated_names", messages=messages)

    if args.who_uses:
        counts = collectives_by_phase(device)
        if rank == 0:
            for phase, calls in counts.items():
                print(f"{phase:<38} {calls if calls else 'no collectives'}")
                metrics.write(event="who_uses", phase=phase, calls=calls)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
