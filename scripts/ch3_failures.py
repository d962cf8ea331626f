"""Reproduce common DDP failures on purpose, each one bounded by a short timeout.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_failures.py --failure mismatched-collective
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ... --failure mismatched-collective   # names the mismatch
    torchrun ... --failure mismatched-collective --fixed
    torchrun ... --failure stuck-rank                  # monitored_barrier names the rank that is late
    torchrun ... --failure stuck-rank --barrier-timeout 1   # ... after waiting 1 s, not --timeout
    torchrun ... --failure unused-parameter            # DDP's error ...
    torchrun ... --failure unused-parameter --find-unused-parameters    # ... and two ways out
    torchrun ... --failure unused-parameter --static-graph
    torchrun ... --failure unused-parameter --both-fixes   # the two ways out above, in one launch
    torchrun ... --failure rank-seed                   # replicas drift apart
    torchrun ... --failure rank-seed --model-seed shared
    torchrun ... --failure rank-seed --ddp             # DDP hides it for parameters only
    torchrun ... --failure rank-seed --all-variants    # the three rank-seed runs above, in one launch
    torchrun ... --failure bad-record                  # a plain bug, dressed up as a distributed one
    python scripts/ch3_failures.py --failure bad-record   # the same bug with one process: plain
    torchrun ... --failure uneven-inputs               # ranks with fewer batches: a hang ...
    torchrun ... --failure uneven-inputs --join        # ... that DDP's join() context resolves
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ... --failure ddp-under-detail   # gloo: SIGSEGV
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ... --failure ddp-under-detail --ddp-own-group

Every run creates its process group with a timeout of --timeout seconds, so a
collective that can never complete raises an error instead of hanging for the
default 10 (NCCL) or 30 (gloo) minutes.
"""

import argparse
import datetime
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_float, positive_int, run_main, script_parser
from dtbook.data import synthetic_corpus
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group
from dtbook.metrics import MetricsWriter
from dtbook.model import GPT, MODEL_SIZES

# Variables that change what torch.distributed reports; each run records what its workers saw.
DEBUG_VARIABLES = ["TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                   "TORCH_NCCL_BLOCKING_WAIT", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"]

FAILURES = ["mismatched-collective", "stuck-rank", "unused-parameter", "rank-seed", "bad-record",
            "uneven-inputs", "ddp-under-detail"]

# Which failure each optional flag belongs to: a flag given to another failure is refused.
FLAG_OWNERS = {
    "fixed": "mismatched-collective",
    "barrier_timeout": "stuck-rank",
    "find_unused_parameters": "unused-parameter",
    "static_graph": "unused-parameter",
    "both_fixes": "unused-parameter",
    "model_seed": "rank-seed",
    "ddp": "rank-seed",
    "all_variants": "rank-seed",
    "join": "uneven-inputs",
    "ddp_own_group": "ddp-under-detail",
}


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--failure", choices=FAILURES, default=FAILURES[0],
                        help=f"which failure to reproduce (default {FAILURES[0]})")
    parser.add_argument("--timeout", type=positive_float, default=5.0,
                        help="process-group timeout in seconds (default 5)")
    parser.add_argument("--steps", type=positive_int, default=10, help="training steps where a failure trains")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fixed", action="store_true",
                        help="mismatched-collective: every rank joins the all_reduce")
    parser.add_argument("--barrier-timeout", type=positive_float, default=None,
                        help="stuck-rank: seconds monitored_barrier waits (default: --timeout)")
    parser.add_argument("--find-unused-parameters", action="store_true",
                        help="unused-parameter: DDP(find_unused_parameters=True)")
    parser.add_argument("--static-graph", action="store_true", help="unused-parameter: DDP(static_graph=True)")
    parser.add_argument("--both-fixes", action="store_true",
                        help="unused-parameter: run --find-unused-parameters, then --static-graph")
    parser.add_argument("--model-seed", choices=["per-rank", "shared"], default=None,
                        help="rank-seed: seed the model with seed+rank (the bug, default) or with seed on every rank")
    parser.add_argument("--ddp", action="store_true",
                        help="rank-seed: train with DDP instead of a hand-written all_reduce of gradients")
    parser.add_argument("--all-variants", action="store_true",
                        help="rank-seed: run per-rank, shared, and per-rank with --ddp one after another")
    parser.add_argument("--join", action="store_true",
                        help="uneven-inputs: train inside DDP's join() context manager")
    parser.add_argument("--ddp-own-group", action="store_true",
                        help="ddp-under-detail: give DDP a process group created without the DETAIL checker")
    add_backend_and_metrics(parser)
    args = parser.parse_args()
    for flag, owner in FLAG_OWNERS.items():
        if getattr(args, flag) not in (None, False) and args.failure != owner:
            raise ScriptError(f"--{flag.replace('_', '-')} applies only to --failure {owner}")
    if args.find_unused_parameters and args.static_graph:
        raise ScriptError("choose one of --find-unused-parameters and --static-graph, not both")
    if args.both_fixes and (args.find_unused_parameters or args.static_graph):
        raise ScriptError("--both-fixes runs --find-unused-parameters, then --static-graph: give neither")
    if args.all_variants and (args.model_seed or args.ddp):
        raise ScriptError("--all-variants runs every --model-seed with and without --ddp: give none of them")
    args.model_seed = args.model_seed or "per-rank"
    return args


def say(message: str) -> None:
    # One write per line, so lines from different ranks sharing a terminal do not run into each other.
    print(f"rank {dist.get_rank()}: {message}\n", end="", flush=True)


# --------------------------------------------------------------------------
# 1. A collective that only some ranks call
# --------------------------------------------------------------------------


def mismatched_collective(args, device: torch.device) -> None:
    """Rank 0 all-reduces the validation loss to log it; then every rank receives
    the early-stopping decision.

    The bug is a collective inside a rank-0-only block: rank 0 waits in all_reduce
    while rank 1 has moved on to broadcast. Neither call can complete, and without a
    timeout both would wait forever.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for epoch in range(2):
        # Stands in for this rank's validation loss on its shard.
        validation_loss = torch.tensor([1.0 + rank], device=device)
        # The bug: the all_reduce sits inside the rank-0-only logging block.
        # --fixed lets every rank join it.
        if args.fixed or rank == 0:
            say(f"epoch {epoch}: all_reduce of the validation loss")
            dist.all_reduce(validation_loss)
        stop = torch.zeros(1, device=device)
        if rank == 0:
            mean_loss = validation_loss.item() / world_size
            print(f"epoch {epoch}: mean validation loss {mean_loss:.3f}", flush=True)
            stop.fill_(float(mean_loss < 0.01))
        # Rank 0 decided whether to stop early; every rank must learn its decision.
        say(f"epoch {epoch}: broadcast of the stop decision")
        dist.broadcast(stop, src=0)
        if stop.item():
            break
    say("finished every epoch")


# --------------------------------------------------------------------------
# 2. A rank that never arrives
# --------------------------------------------------------------------------


def stuck_rank(args, device: torch.device) -> None:
    """Rank 1 is stuck (think: a data loader waiting on a dead file system) while
    rank 0 waits for it.

    A plain barrier would only say that it timed out; monitored_barrier says which
    rank is missing. It exists for gloo only, so on NCCL we create a gloo group for
    it, a collective that every rank makes.

    The barrier's own timeout covers only the wait for the late rank, not the
    forming of the group, so it can be shorter than --timeout without risk.
    """
    on_gloo = dist.get_backend() == "gloo"
    monitor_group = None if on_gloo else dist.new_group(backend="gloo")
    wait_s = args.barrier_timeout or args.timeout
    if dist.get_rank() == 1:
        # Late by far more than the barrier waits, so a busy machine cannot
        # let it arrive in time; torchrun stops it once rank 0 has failed.
        say(f"stuck for {3 * args.timeout:g} s")
        time.sleep(3 * args.timeout)
    say("waiting in monitored_barrier")
    dist.monitored_barrier(group=monitor_group,
                           timeout=datetime.timedelta(seconds=wait_s))
    say("passed the barrier")


# --------------------------------------------------------------------------
# 3. A parameter that forward never uses
# --------------------------------------------------------------------------


class LanguageModelWithAuxHead(nn.Module):
    """The book's GPT plus an auxiliary head whose loss a setting can turn off.

    With the auxiliary loss off, ``aux_head`` takes no part in forward, so its
    parameters never get a gradient; DDP waits for those gradients to fill its
    buckets and cannot finish the reduction.
    """

    def __init__(self, use_aux_loss: bool):
        super().__init__()
        cfg = MODEL_SIZES["tiny"]
        self.lm = GPT(cfg)
        self.aux_head = nn.Linear(cfg.vocab_size, 1)
        self.use_aux_loss = use_aux_loss

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        if self.use_aux_loss:
            loss = loss + 0.01 * self.aux_head(logits.mean(dim=1)).square().mean()
        return loss


def unused_parameter_runs(args) -> list[argparse.Namespace]:
    """The unused-parameter runs one launch makes: the one its flags ask for, or with --both-fixes each fix."""
    if not args.both_fixes:
        return [args]
    return [argparse.Namespace(**{**vars(args), "find_unused_parameters": walk, "static_graph": not walk})
            for walk in (True, False)]


def unused_parameter(args, device: torch.device, metrics: MetricsWriter) -> None:
    setting = ("find_unused_parameters" if args.find_unused_parameters
               else "static_graph" if args.static_graph else "default")
    torch.manual_seed(args.seed)
    model = LanguageModelWithAuxHead(use_aux_loss=False).to(device)
    ddp_model = DDP(model, device_ids=ddp_device_ids(device),
                    find_unused_parameters=args.find_unused_parameters, static_graph=args.static_graph)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
    tokens = synthetic_corpus(20_000, model.lm.cfg.vocab_size, seed=args.seed)
    context, batch = 32, 8
    generator = torch.Generator().manual_seed(args.seed + dist.get_rank())  # each rank its own batches
    for step in range(args.steps):
        starts = torch.randint(0, len(tokens) - context - 1, (batch,), generator=generator)
        idx = torch.stack([tokens[s : s + context] for s in starts]).to(device)
        targets = torch.stack([tokens[s + 1 : s + context + 1] for s in starts]).to(device)
        loss = ddp_model(idx, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        # The setting in the line tells the runs of one --both-fixes launch apart.
        say(f"step {step} loss {loss.item():.3f} ({setting})")
        metrics.write(event="step", setting=setting, step=step, loss=loss.item())
    aux_grad = model.aux_head.weight.grad
    metrics.write(event="summary", setting=setting, steps=args.steps,
                  aux_head_has_grad=aux_grad is not None)


# --------------------------------------------------------------------------
# 4. Rank-dependent randomness
# --------------------------------------------------------------------------


class RandomFeatureRegressor(nn.Module):
    """Random Fourier features followed by a small MLP.

    ``projection`` is drawn once and never trained, and it is a plain tensor
    attribute: neither a parameter nor a registered buffer, so DDP does not know it
    exists and never broadcasts it.
    """

    def __init__(self, inputs: int = 8, features: int = 64):
        super().__init__()
        self.projection = torch.randn(inputs, features)
        self.mlp = nn.Sequential(nn.Linear(features, 64), nn.Tanh(),
                                 nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cos(x @ self.projection.to(x.device)))


# What --all-variants runs, in this order: the bug, the fix, the bug under DDP.
RANK_SEED_VARIANTS = [("per-rank", False), ("shared", False), ("per-rank", True)]


def rank_seed_runs(args) -> list[argparse.Namespace]:
    """The rank-seed runs one launch makes: the one its flags ask for, or with --all-variants each variant."""
    if not args.all_variants:
        return [args]
    return [argparse.Namespace(**{**vars(args), "model_seed": seed, "ddp": ddp})
            for seed, ddp in RANK_SEED_VARIANTS]


def spread_across_ranks(tensor: torch.Tensor) -> float:
    """Largest absolute difference between this tensor on any rank and on rank 0 (same on every rank)."""
    copies = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tensor.contiguous())
    return max((c - copies[0]).abs().max().item() for c in copies)


def rank_seed(args, device: torch.device, metrics: MetricsWriter) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # The bug: seeding with the rank *before* the model is built gives every rank
    # different weights.
    model_seed = args.seed + rank if args.model_seed == "per-rank" else args.seed
    torch.manual_seed(model_seed)
    model = RandomFeatureRegressor().to(device)
    if args.ddp:
        # DDP broadcasts rank 0's weights.
        model = DDP(model, device_ids=ddp_device_ids(device))
    # Data, on the other hand, should differ: each rank draws its own batches.
    torch.manual_seed(args.seed + 1000 + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(args.steps):
        x = torch.randn(32, 8, device=device)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if not args.ddp:
            # A hand-written data-parallel step: average the gradients.
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
        optimizer.step()

    inner = model.module if args.ddp else model
    weights = torch.cat([p.detach().flatten() for p in inner.parameters()])
    # The same input on every rank.
    probe = torch.linspace(-1, 1, 8 * 4, device=device).view(4, 8)
    with torch.no_grad():
        outputs = inner(probe)
    result = dict(
        model_seed=args.model_seed, ddp=args.ddp, steps=args.steps,
        parameter_spread=spread_across_ranks(weights),
        projection_spread=spread_across_ranks(inner.projection.to(device)),
        output_spread=spread_across_ranks(outputs),
    )
    say(f"training done, last local loss {loss.item():.4f}")
    if rank == 0:
        print("largest difference from rank 0 — parameters: {parameter_spread:.3g}, "
              "projection: {projection_spread:.3g}, output on a shared input: "
              "{output_spread:.3g}".format(**result),
              flush=True)
    metrics.write(event="divergence", **result)


# --------------------------------------------------------------------------
# 5. An ordinary bug that only one rank reaches
# --------------------------------------------------------------------------


def bad_record(args, device: torch.device) -> None:
    """One record of the data set is truncated; of two ranks only rank 1 sees it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    records = [torch.full((8,), float(i)) for i in range(64)]
    records[37] = records[37][:5]  # the corrupt record
    shard = records[rank::world_size]
    torch.manual_seed(args.seed)
    model = nn.Linear(8, 1).to(device)
    ddp_model = DDP(model, device_ids=ddp_device_ids(device))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    batch_size = 4
    for step, first in enumerate(range(0, len(shard), batch_size)):
        batch = torch.stack(shard[first : first + batch_size]).to(device)
        loss = ddp_model(batch).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        say(f"step {step} done")
    say("finished")


# --------------------------------------------------------------------------
# 6. Ranks with different numbers of batches
# --------------------------------------------------------------------------


def uneven_inputs(args, device: torch.device, metrics: MetricsWriter) -> None:
    """Rank r has 3 + 2r batches: a plain DDP loop hangs when the first runs out.

    Rank 0 leaves the loop after its last batch and goes on to the next collective
    (the all_gather that compares the replicas), while rank 1's next backward waits
    for rank 0 in DDP's all-reduce. Inside model.join(), a rank that has run out of
    data keeps answering the others' all-reduces (with zeros) until all are done.
    """
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(nn.Linear(8, 1).to(device), device_ids=ddp_device_ids(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 3 + 2 * rank
    data = torch.Generator().manual_seed(args.seed + rank)
    with model.join() if args.join else nullcontext():
        for step in range(batches):
            x = torch.randn(4, 8, generator=data).to(device)
            loss = model(x).square().mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            say(f"step {step + 1} of {batches} done")
    say(f"out of data after {batches} batches")
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    spread = spread_across_ranks(weights)
    say(f"replicas differ by at most {spread:.3g}")
    metrics.write(event="summary", join=args.join, replica_spread=spread,
                  batches=[3 + 2 * r for r in range(dist.get_world_size())])


# --------------------------------------------------------------------------
# 7. DDP under TORCH_DISTRIBUTED_DEBUG=DETAIL
# --------------------------------------------------------------------------


def ddp_under_detail(args, device: torch.device) -> None:
    """The smallest program that shows the crash: build a DDP model, take one step.

    Under DETAIL every process group is wrapped in a checker of collective calls,
    and on gloo DDP's constructor then crashes (torch 2.13). --ddp-own-group gives
    DDP a process group created while the level is INFO, so it is not wrapped;
    every other collective, on the default group, is still checked.
    """
    checked = type(dist.group.WORLD._get_backend(device)).__name__
    say(f"default group's backend object: {checked}")
    group = None
    if args.ddp_own_group:
        level = dist.get_debug_level()
        dist.set_debug_level(dist.DebugLevel.INFO)  # a group made now is not wrapped
        group = dist.new_group(backend=dist.get_backend())
        dist.set_debug_level(level)
        say(f"DDP's group: {type(group._get_backend(device)).__name__}")
    model = DDP(nn.Linear(8, 1).to(device), device_ids=ddp_device_ids(device),
                process_group=group)
    say("DDP constructed")
    model(torch.randn(4, 8, device=device)).sum().backward()
    say("one backward done")


def main() -> None:
    args = parse_args()
    needs_two = ("mismatched-collective", "stuck-rank", "uneven-inputs")
    if args.failure in needs_two and int(os.environ.get("WORLD_SIZE", 1)) < 2:
        raise ScriptError(f"--failure {args.failure} needs at least 2 processes (torchrun --nproc_per_node=2)")
    backend, device = start_process_group(args.backend, timeout_s=args.timeout)
    metrics = open_metrics(args.metrics, backend, device)
    metrics.write(event="config", failure=args.failure, timeout=args.timeout,
                  env={name: os.environ.get(name) for name in DEBUG_VARIABLES})
    if args.failure == "mismatched-collective":
        mismatched_collective(args, device)
    elif args.failure == "stuck-rank":
        stuck_rank(args, device)
    elif args.failure == "unused-parameter":
        for run in unused_parameter_runs(args):
            unused_parameter(run, device, metrics)
    elif args.failure == "rank-seed":
        for run in rank_seed_runs(args):
            if args.all_variants and dist.get_rank() == 0:
                print(f"--model-seed {run.model_seed}{' --ddp' if run.ddp else ''}:", flush=True)
            rank_seed(run, device, metrics)
    elif args.failure == "uneven-inputs":
        uneven_inputs(args, device, metrics)
    elif args.failure == "ddp-under-detail":
        ddp_under_detail(args, device)
    else:
        bad_record(args, device)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
