"""All-reduce written by hand from point-to-point messages: a ring, recursive doubling, Rabenseifner.

    torchrun --standalone --nproc_per_node=4 scripts/ch2_ring_all_reduce.py --sizes
    torchrun --standalone --nproc_per_node=2 scripts/ch2_ring_all_reduce.py
    torchrun --standalone --nproc_per_node=3 scripts/ch2_ring_all_reduce.py --algorithms ring

ring                a reduce-scatter then an all-gather around the ring of ranks, N-1 steps each;
                    every rank sends 2(N-1)/N of the tensor, the least any all-reduce can send
recursive_doubling  log2(N) steps; in step k every rank swaps its whole tensor with rank XOR 2^k
                    and adds: fewer steps, but n * log2(N) bytes sent; N must be a power of two
rabenseifner        reduce-scatter by recursive halving, then all-gather by recursive doubling:
                    2 log2(N) steps and the ring's 2(N-1)/N of the tensor; N a power of two

First both are checked against dist.all_reduce on tensors of --check-elements float32 elements:
bit-identical results on integer-valued tensors (every partial sum is exact), results within
float32 rounding on random ones, identical results on every rank, and the bytes each rank sent
against the formulas. Then all of them and dist.all_reduce are timed at each of --sizes: the median of --rounds rounds
of back-to-back calls, each round ending when its slowest rank is done (dtbook/comm_timing.py),
and at the largest size the minor page faults of one call of each are counted: the fresh memory
a call touches (the buffers the algorithms allocate).
"""

import argparse
import hashlib
import os
import resource
import statistics
from functools import partial

import torch
import torch.distributed as dist

from dtbook.cli import (
    ScriptError,
    add_backend_and_metrics,
    byte_size,
    format_bytes,
    positive_float,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.comm_timing import calls_per_round, seconds_per_call
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group
from dtbook.measure import page_faults_per_call

FLOAT32_UNIT_ROUNDOFF = 2.0**-24  # u: the largest relative rounding error of a float32 add


def exchange(send: torch.Tensor, to: int, receive: torch.Tensor, source: int) -> int:
    """Send one tensor and receive another at the same time; return the bytes sent.

    batch_isend_irecv posts both before waiting on either, so neighbours that all
    send first cannot wait for each other forever. Empty tensors (a tensor with fewer
    elements than there are ranks has empty chunks) are not sent: the receiver skips
    them too.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, to))
    if receive.numel():
        ops.append(dist.P2POp(dist.irecv, receive, source))
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    return send.numel() * send.element_size()


def ring_all_reduce(tensor: torch.Tensor) -> int:
    """Sum ``tensor`` over all ranks, in place; return the bytes this rank sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    # views: writing one writes the tensor
    chunks = tensor.view(-1).tensor_split(world)
    incoming = torch.empty_like(chunks[0])  # the first chunk is the largest
    sent = 0
    # Reduce-scatter: partial sums travel around the ring, each rank adding its own
    # part.
    # After N-1 steps, rank r holds the complete sum of chunk (r + 1) % N.
    for step in range(world - 1):
        send, receive = (rank - step) % world, (rank - step - 1) % world
        buffer = incoming[: chunks[receive].numel()]
        sent += exchange(chunks[send], right, buffer, left)
        chunks[receive].add_(buffer)
    # All-gather: the complete chunks travel around the ring, replacing partial ones.
    for step in range(world - 1):
        send, receive = (rank + 1 - step) % world, (rank - step) % world
        sent += exchange(chunks[send], right, chunks[receive], left)
    return sent


def recursive_doubling_all_reduce(tensor: torch.Tensor) -> int:
    """Sum ``tensor`` over a power-of-two number of ranks, in place; return bytes
    sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(tensor)
    sent, distance = 0, 1
    # after the step with distance d, groups of 2d ranks agree
    while distance < world:
        partner = rank ^ distance
        sent += exchange(tensor, partner, incoming, partner)
        tensor.add_(incoming)  # a + b here, b + a at the partner: the same bits
        distance *= 2
    return sent


def rabenseifner_all_reduce(tensor: torch.Tensor) -> int:
    """Sum ``tensor`` over a power-of-two number of ranks, in place: a
    reduce-scatter by recursive halving, then an all-gather by recursive doubling.
    Return the bytes sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    bounds = [0]  # chunk i is flat[bounds[i]:bounds[i + 1]], as tensor_split cuts it
    for chunk in flat.tensor_split(world):
        bounds.append(bounds[-1] + chunk.numel())

    # chunks first..end-1: one view
    def chunks(first: int, end: int) -> torch.Tensor:
        return flat[bounds[first]:bounds[end]]

    # the lower half is the larger
    incoming = torch.empty_like(chunks(0, world // 2))
    first, end, sent, distance = 0, world, 0, world // 2
    # Reduce-scatter: give the partner the half it keeps, add the half it gives back.
    # After the step with distance d, rank r holds partial sums over world/d ranks
    # of a range of chunks that halves each step; at the end, the complete sum of
    # chunk r.
    while distance:
        middle = (first + end) // 2
        keep, give = ((first, middle), (middle, end)) if rank & distance == 0 else \
            ((middle, end), (first, middle))
        mine = chunks(*keep)
        buffer = incoming[: mine.numel()]
        sent += exchange(chunks(*give), rank ^ distance, buffer, rank ^ distance)
        mine.add_(buffer)
        (first, end), distance = keep, distance // 2
    # All-gather: the same partners in reverse order, the complete ranges doubling.
    distance = 1
    while distance < world:
        size = end - first
        theirs = (first - size, first) if rank & distance else (end, end + size)
        sent += exchange(chunks(first, end), rank ^ distance,
                         chunks(*theirs), rank ^ distance)
        first, end, distance = (min(first, theirs[0]), max(end, theirs[1]),
                                distance * 2)
    return sent


ALGORITHMS = {"ring": ring_all_reduce, "recursive_doubling": recursive_doubling_all_reduce,
              "rabenseifner": rabenseifner_all_reduce}


def expected_bytes_sent(algorithm: str, elements: int, world: int) -> float:
    """Bytes each rank sends by the formulas, for a float32 tensor that N divides evenly."""
    n = elements * 4
    if algorithm in ("ring", "rabenseifner"):
        return 2 * (world - 1) / world * n
    return n * (world.bit_length() - 1)  # n * log2(N)


def fingerprint(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()


def check(name: str, elements: int, device: torch.device) -> dict:
    """Compare one algorithm with dist.all_reduce on integer-valued and on random float32 tensors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    integers = torch.randint(-1000, 1001, (elements,), generator=generator).float().to(device)
    floats = torch.randn(elements, generator=generator).to(device)

    results = {}
    for kind, x in (("integers", integers), ("floats", floats)):
        reference = x.clone()
        dist.all_reduce(reference)
        mine = x.clone()
        sent = ALGORITHMS[name](mine)
        everyone = [None] * world
        dist.all_gather_object(everyone, (sent, fingerprint(mine)))
        results[kind] = {"sent": [s for s, _ in everyone], "same_on_all_ranks": len({f for _, f in everyone}) == 1,
                         "bitwise_equal": torch.equal(mine, reference),
                         "differing_elements": int((mine != reference).sum())}
        if kind == "floats":
            results[kind].update(rounding_units(x, mine, reference))
    return {"algorithm": name, "elements": elements, "world_size": world, **results}


def rounding_units(x: torch.Tensor, mine: torch.Tensor,
                   reference: torch.Tensor) -> dict:
    """The largest difference from the reference, in units of u * sum(|x_i|).

    Summing N float32 numbers in any order is off from the exact sum by at most
    about (N-1) * u * sum_i |x_i| (each addition rounds once), so two orders differ
    by at most twice that. The control drops rank 0's contribution: a bug that size
    must be caught.
    """
    magnitude = x.abs()
    dist.all_reduce(magnitude)  # sum over ranks of |x_i|, per element
    rank0 = x.clone()
    dist.broadcast(rank0, src=0)
    scale = FLOAT32_UNIT_ROUNDOFF * magnitude.clamp_min(
        torch.finfo(torch.float32).tiny)
    units = ((mine - reference).abs() / scale).max().item()
    control = ((mine - rank0 - reference).abs() / scale).max().item()
    worst = torch.tensor([units, control], dtype=torch.float64, device=x.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"rounding_units": worst[0].item(),
            "control_rounding_units": worst[1].item(),
            "bound_units": 2 * (dist.get_world_size() - 1)}


def time_algorithms(args, device) -> list[dict]:
    """Seconds per call of each algorithm and of dist.all_reduce at each size."""
    world = dist.get_world_size()
    contenders = {name: ALGORITHMS[name] for name in args.algorithms} | {"dist.all_reduce": dist.all_reduce}
    rows, faults = [], {}
    for nbytes in args.sizes:
        elements = max(world, nbytes // 4 // world * world)
        tensor = torch.zeros(elements, device=device)  # zeros stay zeros, however often they are summed
        for name, algorithm in contenders.items():
            call = partial(algorithm, tensor)
            calls, _ = calls_per_round(call, args.round_seconds, args.max_calls, device)
            per_call = seconds_per_call(call, calls, args.rounds, device)
            rows.append({"algorithm": name, "nbytes": elements * 4, "world_size": world,
                         "seconds": statistics.median(per_call), "calls_per_round": calls,
                         "round_seconds": per_call})
            if nbytes == max(args.sizes):
                faults[name] = page_faults_per_call(call)
    return rows, faults


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--algorithms", nargs="+", choices=list(ALGORITHMS), default=list(ALGORITHMS),
        help="(default: both)")
    add("--check-elements", nargs="*", type=positive_int, default=[1, 3, 4099, 12288, 65536],
        help="tensor lengths for the correctness checks (default: 1 3 4099 12288 65536); "
             "none: only time")
    add("--sizes", nargs="*", type=byte_size,
        default=[4, 64, 2**10, 2**14, 2**18, 2**22, 2**26],
        help="message sizes to time (default: 4 B to 64 MiB, x16 apart); none: only check")
    add("--rounds", type=positive_int, default=5, help="timed rounds per size (default 5)")
    add("--round-seconds", type=positive_float, default=0.02, help="seconds per round, at least 1 call")
    add("--max-calls", type=positive_int, default=200, help="at most this many calls per round (default 200)")
    add_backend_and_metrics(parser)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    needs_power_of_two = [a.replace("_", " ") for a in args.algorithms if a != "ring"]
    if needs_power_of_two and world & (world - 1):
        raise ScriptError(f"{' and '.join(needs_power_of_two)}: a power-of-two number of processes "
                          f"is needed, not {world}: add --algorithms ring")
    return args


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)

    for name in args.algorithms:
        for elements in args.check_elements:
            result = check(name, elements, device)
            metrics.write(event="check", **result)
            integers, floats = result["integers"], result["floats"]
            passed = (integers["bitwise_equal"] and integers["same_on_all_ranks"] and floats["same_on_all_ranks"]
                      and floats["rounding_units"] <= floats["bound_units"] < floats["control_rounding_units"])
            if rank == 0:
                print(f"{name:<18} {elements:>6} elements: integers bit-identical {integers['bitwise_equal']}, "
                      f"floats within {floats['rounding_units']:.2f} of {floats['bound_units']} rounding units "
                      f"({floats['differing_elements']} elements differ in the last bits); "
                      f"bytes sent per rank {integers['sent']}", flush=True)
            if not passed:
                raise ScriptError(f"{name} disagrees with dist.all_reduce on {elements} elements: {result}")

    rows, faults = time_algorithms(args, device) if args.sizes else ([], {})
    for row in rows:
        metrics.write(event="timing", **row)
    if faults:
        largest = max(r["nbytes"] for r in rows)
        metrics.write(event="page_faults", nbytes=largest, page_bytes=resource.getpagesize(),
                      per_call=faults)
    if rank == 0 and rows:
        names = list(dict.fromkeys(r["algorithm"] for r in rows))
        print(f"\nmicroseconds per call, {world} processes, {backend} (median of {args.rounds} rounds)")
        print(f"{'size':>10} " + " ".join(f"{n:>18}" for n in names) + f" {'ring / dist':>12}")
        for nbytes in dict.fromkeys(r["nbytes"] for r in rows):
            at = {r["algorithm"]: r["seconds"] for r in rows if r["nbytes"] == nbytes}
            ratio = f"{at['ring'] / at['dist.all_reduce']:>12.2f}" if "ring" in at else ""
            print(f"{format_bytes(nbytes):>10} " + " ".join(f"{at[n] * 1e6:>18.1f}" for n in names) + ratio)
        print(f"minor page faults per call at {format_bytes(largest)} on rank 0 "
              f"({largest // resource.getpagesize()} pages): "
              + ", ".join(f"{name} {n:.0f}" for name, n in faults.items()))
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
