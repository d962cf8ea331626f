"""Train the book's GPT with Fully Sharded Data Parallel: chapter 3's program,
sharded.

    torchrun --standalone --nproc_per_node=2 scripts/ch4_fsdp.py                    # FSDP2, full sharding
    torchrun --standalone --nproc_per_node=2 scripts/ch4_fsdp.py --api fsdp1 --sharding grad_op
    torchrun --standalone --nproc_per_node=4 scripts/ch4_fsdp.py --sharding hybrid --shard-group-size 2
    torchrun --standalone --nproc_per_node=2 scripts/ch4_fsdp.py --checkpoint-dir runs/ckpt --resume
    torchrun --standalone --nproc_per_node=2 scripts/ch4_fsdp.py --grad-clip 0.5 --compile aot_eager
    python scripts/ch4_fsdp.py                                                      # a world of one

Same model, data, flags and metrics as ch3_train.py, but no process holds the whole
model: each keeps a 1/N shard of every parameter, gradient and optimizer state.
Before a block runs forward (and again before its backward) its parameters are
all-gathered; after backward its gradients are reduce-scattered, so each rank
receives the averaged gradient of its own shard and steps only that. With --api fsdp2
(the default, torch.distributed.fsdp.fully_shard) the parameters are DTensors; --api
fsdp1 is the older FullyShardedDataParallel wrapper.

--sharding full       shard everything, free gathered parameters after forward
(ZeRO-3) --sharding grad_op    keep gathered parameters from forward to backward
(ZeRO-2-like) --sharding no_shard   replicate like DDP (FSDP1 only) --sharding hybrid
shard within groups of --shard-group-size processes, replicate across them

Checkpoints are sharded (torch.distributed.checkpoint): every rank writes its own
shards, and a checkpoint loads into any number of processes. --resume continues from
the newest complete checkpoint, as in chapter 3, and with the same number of
processes it continues bit for bit. --save-final gathers the full weights to rank 0
and writes one ordinary state dict file.

--grad-clip MAX_NORM clips by the norm of the whole gradient, which no rank holds:
FSDP2's clip_grad_norm_ reduces the DTensor shards' norms across the mesh, FSDP1's
model.clip_grad_norm_ all-reduces them. --compile compiles every transformer block
(torch.compile, then fully_shard); aot_eager traces without generating code,
inductor also compiles C++ (slow on a CPU: one compiler run per graph).
"""

import argparse
import contextlib
import dataclasses
import functools
import itertools
import math
import os
import random
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch._dynamo.utils
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from dtbook.checkpoint import (
    atomic_save,
    capture_rng_state,
    checkpoint_paths,
    newest_loadable,
    restore_rng_state,
    state_dict_fingerprint,
)
from dtbook.cli import (
    ScriptError,
    add_backend_and_metrics,
    check_training_inputs,
    one_line,
    positive_float,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.collectives import CollectiveLog
from dtbook.data import DEFAULTS, corpus_windows, rank_loader
from dtbook.distributed import (
    choose_backend,
    drain_gloo_workers,
    fill_in_launch_variables,
    open_metrics,
    process_group_device,
)
from dtbook.model import GPT, MODEL_SIZES, Block
from dtbook.progress import Progress

FSDP1_STRATEGIES = {
    "full": ShardingStrategy.FULL_SHARD,
    "grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "no_shard": ShardingStrategy.NO_SHARD,
    "hybrid": ShardingStrategy.HYBRID_SHARD,
}
TRAIN_STATE_KEYS = {"step", "epoch", "step_in_epoch", "rng", "meta"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--api", choices=["fsdp2", "fsdp1"], default="fsdp2",
        help="fully_shard (fsdp2, default) or the FullyShardedDataParallel wrapper "
             "(fsdp1)")
    add("--sharding", choices=sorted(FSDP1_STRATEGIES), default="full",
        help="what to shard (default: full)")
    add("--shard-group-size", type=positive_int,
        help="--sharding hybrid: processes per shard group (default: the processes "
             "on one node)")
    add("--wrap", choices=["block", "size"], default="block",
        help="FSDP units: one per transformer block, or FSDP1's size-based policy "
             "(default: block)")
    add("--min-wrap-params", type=positive_int, default=20_000,
        help="--wrap size: wrap every module with at least this many parameters "
             "(default: 20000)")
    add("--mixed-precision", choices=["off", "bf16"], default="off",
        help="bf16 parameters for compute, fp32 master weights and gradient "
             "reduction (default: off)")
    add("--cpu-offload", action="store_true",
        help="keep sharded parameters, gradients and optimizer state on the CPU")
    add("--activation-checkpointing", action="store_true",
        help="recompute each block's activations in backward instead of storing them")
    add("--meta-init", action="store_true",
        help="build the model on the meta device, shard it, then materialize and "
             "initialize the shards")
    add("--prefetch", choices=["implicit", "explicit"], default="implicit",
        help="explicit: each block asks for the next block's all-gather before it "
             "runs (default: implicit)")
    add("--grad-clip", type=positive_float, metavar="MAX_NORM",
        help="clip the gradient to this total L2 norm before each optimizer step; "
             "records the norm and each rank's local shards' norm every step")
    add("--compile", choices=["off", "aot_eager", "inductor"], default="off",
        help="torch.compile every transformer block with this backend before "
             "sharding it (FSDP2 only; default: off)")
    add("--count-comm", action="store_true",
        help="record every collective of the first optimizer step")
    add("--model", choices=sorted(MODEL_SIZES), default="small",
        help="model size (default: small)")
    add("--dropout", type=float, default=0.0,
        help="dropout probability; 0 (default) keeps runs comparable across world "
             "sizes")
    add("--corpus-tokens", type=positive_int, default=DEFAULTS.corpus_tokens,
        help="length of the synthetic corpus (default: 160000 tokens = 2499 windows)")
    add("--epochs", type=positive_int, default=3,
        help="passes over the corpus (default: 3)")
    add("--max-steps", type=positive_int,
        help="stop after this many optimizer steps; overrides --epochs")
    add("--batch-size", type=positive_int, default=DEFAULTS.batch_size,
        help="windows per process per micro-step (default: 16)")
    add("--accum-steps", type=positive_int, default=1,
        help="micro-steps per optimizer step; only the last one reduce-scatters "
             "(default: 1)")
    add("--lr", type=positive_float, default=DEFAULTS.lr,
        help="AdamW learning rate (default: 0.01)")
    add("--seed", type=int, default=DEFAULTS.seed,
        help="seeds the corpus, the initial weights and the shuffle")
    add("--checkpoint-dir", type=Path,
        help="where every rank writes its checkpoint shards")
    add("--save-every", type=positive_int, default=50,
        help="checkpoint every N optimizer steps, and at the end (default: 50)")
    add("--keep", type=positive_int, default=2,
        help="how many newest checkpoints to keep")
    add("--async-save", action="store_true",
        help="write checkpoints in the background (dcp.async_save) while training "
             "goes on")
    add("--resume", action="store_true",
        help="continue from the newest complete checkpoint in --checkpoint-dir")
    add("--log-every", type=positive_int, default=10,
        help="log the loss every N steps")
    add("--print-every", type=positive_int,
        help="print progress on the console every N steps (default: every logged "
             "step)")
    add("--save-final", type=Path,
        help="gather the full weights and let rank 0 write them here")
    add("--crash-at-step", type=positive_int,
        help="fault injection: SIGKILL one process right after this optimizer step")
    add("--crash-rank", type=int,
        help="the process --crash-at-step kills (default: the last rank)")
    add_backend_and_metrics(parser)
    args = parser.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    if args.async_save and args.checkpoint_dir is None:
        parser.error("--async-save needs --checkpoint-dir")
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    return args


# --------------------------------------------------------------------------
# What can be checked before joining the process group
# --------------------------------------------------------------------------


def check_inputs(args, world_size: int, local_world_size: int, num_windows: int,
                 on_gpu: bool) -> None:
    """Refuse impossible combinations with one line each, on every rank, before
    any collective."""
    if args.api == "fsdp2" and args.sharding == "no_shard":
        raise ScriptError("FSDP2 has no no_shard strategy: a fully replicated model "
                          "is DDP (ch3_train.py), or use --api fsdp1 --sharding "
                          "no_shard")
    if args.api == "fsdp2" and args.wrap == "size":
        raise ScriptError("--wrap size is an FSDP1 auto-wrap policy; FSDP2 is "
                          "applied per block (--wrap block) or use --api fsdp1")
    if args.shard_group_size and args.sharding != "hybrid":
        raise ScriptError("--shard-group-size only applies to --sharding hybrid")
    if args.sharding == "hybrid":
        shards = args.shard_group_size or local_world_size
        if shards > world_size or world_size % shards:
            raise ScriptError(f"--sharding hybrid cannot build a mesh: {world_size} "
                              "process(es) do not split into shard groups of "
                              f"{shards}; pick a --shard-group-size that divides "
                              f"{world_size}")
        args.shard_group_size = shards
    if args.api == "fsdp1" and args.cpu_offload and not on_gpu:
        raise ScriptError("FSDP1's CPU offload needs CUDA devices to offload from; "
                          "use --api fsdp2 (whose offload policy also runs on "
                          "CPU-only machines)")
    if args.api == "fsdp1" and args.compile != "off":
        raise ScriptError("--compile compiles each block before fully_shard, an FSDP2 "
                          "recipe; this program does not compile FSDP1 units: use "
                          "--api fsdp2")
    if args.api == "fsdp1" and args.meta_init:
        raise ScriptError("--meta-init uses FSDP2's to_empty on sharded DTensors; "
                          "with FSDP1 it would need a param_init_fn: use --api fsdp2")
    check_training_inputs(args, world_size, num_windows)


# --------------------------------------------------------------------------
# Building the sharded model
# --------------------------------------------------------------------------


def build_mesh(args, world_size: int, device: torch.device) -> DeviceMesh:
    """One dimension of `world_size` ranks, or (replicas, shard group) for hybrid
    sharding."""
    if args.sharding == "hybrid":
        shape = (world_size // args.shard_group_size, args.shard_group_size)
        return init_device_mesh(device.type, shape,
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))


def checkpoint_activations(block: Block) -> None:
    """Keep only the block's input; recompute the rest of its activations during
    backward.

    The block's forward is replaced on the instance, so parameter names stay what
    they were and checkpoints remain interchangeable with runs that do not
    recompute.
    """
    forward = block.forward
    block.forward = lambda x: checkpoint(forward, x, use_reentrant=False)


def shard_fsdp2(model: GPT, args, mesh: DeviceMesh) -> GPT:
    """fully_shard each block, then the root (embeddings, head and final norm)."""
    bf16 = args.mixed_precision == "bf16"
    # Compute in bf16, but reduce gradients in fp32: summing N bf16 gradients loses
    # bits.
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                     reduce_dtype=torch.float32 if bf16 else None)
    if args.cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    else:
        offload = OffloadPolicy()
    # full and hybrid free a block's gathered parameters after its forward and gather
    # them again for backward; grad_op keeps them until backward is done (one
    # all-gather).
    reshard = args.sharding != "grad_op"
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard,
                    mp_policy=mp_policy,
                    offload_policy=offload)
    # The root's parameters (the embedding, tied to the head) are needed again as
    # soon as backward starts, so it keeps them through the step (FSDP2's default for
    # a root).
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy,
                offload_policy=offload)
    if args.prefetch == "explicit":
        blocks = list(model.blocks)
        for this, following in zip(blocks, blocks[1:], strict=False):
            # Block i gathers block i+1 as it starts; i+1's backward gathers block i.
            this.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([this])
    return model


def shard_fsdp1(model: GPT, args, mesh: DeviceMesh, device: torch.device) -> FSDP:
    """The FullyShardedDataParallel wrapper: an auto-wrap policy decides the
    units."""
    if args.wrap == "block":
        policy = ModuleWrapPolicy({Block})
    else:
        # The embedding and the head share one weight, so neither may become a unit
        # of its own: a tied weight split across two units is gathered by one,
        # missing in the other.
        tied = {model.tok_emb, model.head}
        by_size = functools.partial(size_based_auto_wrap_policy,
                                    min_num_params=args.min_wrap_params)

        def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            return module not in tied and by_size(module, recurse, nonwrapped_numel)
    bf16 = args.mixed_precision == "bf16"
    mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                           buffer_dtype=torch.bfloat16) if bf16 else None
    return FSDP(
        model,
        sharding_strategy=FSDP1_STRATEGIES[args.sharding],
        auto_wrap_policy=policy,
        mixed_precision=mixed,
        cpu_offload=CPUOffload(offload_params=args.cpu_offload),
        device_id=device,  # the CPU too: without a device_id FSDP1 looks for a GPU
        device_mesh=mesh if args.sharding == "hybrid" else None,
        forward_prefetch=args.prefetch == "explicit",
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        # the optimizer and state dicts see the original parameters
        use_orig_params=True,
    )


def build_model(args, device: torch.device, rank: int, mesh: DeviceMesh):
    """The sharded GPT, its AdamW optimizer (over this rank's shards only), its
    size."""
    cfg = dataclasses.replace(MODEL_SIZES[args.model], dropout=args.dropout)
    # The same seed everywhere gives every rank the same full model, which each
    # shards.
    torch.manual_seed(args.seed)
    if args.meta_init:
        with torch.device("meta"):  # shapes only: no memory, no initialization
            model = GPT(cfg)
    else:
        model = GPT(cfg).to(device)
    # the tied head counts once
    n_params = sum(p.numel() for p in model.parameters())
    if args.activation_checkpointing:
        for block in model.blocks:
            checkpoint_activations(block)
    if args.compile != "off":
        for block in model.blocks:
            # In place (Module.compile): the parameter names, and so the checkpoints,
            # stay those of the eager model. FSDP2's hooks, added next, run outside
            # the graphs: torch 2.13 marks them torch._dynamo.disable.
            block.compile(backend=args.compile)
    if args.api == "fsdp2":
        model = shard_fsdp2(model, args, mesh)
    else:
        model = shard_fsdp1(model, args, mesh, device)
    if args.meta_init:
        materialize(model, args, mesh, device)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return model, optimizer, n_params


def materialize(model: GPT, args, mesh: DeviceMesh, device: torch.device) -> None:
    """Allocate each rank's shards of a meta-device model, then initialize them
    in place.

    The full model never exists anywhere. On GPUs, DTensor's random generator
    draws every shard from one seed, as a slice of one full tensor. A CPU mesh
    has no such generator, so each shard is drawn from a seed of its own;
    replicas of a shard (hybrid sharding) share that seed and so stay identical.
    """
    model.to_empty(device="cpu" if args.cpu_offload else device)
    if device.type == "cuda":
        torch.manual_seed(args.seed)
    else:
        torch.manual_seed(args.seed + mesh.get_local_rank("shard"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DTensor random operators may not have")
        model.init_weights()


def describe_units(model) -> list[str]:
    """The names of the modules that became FSDP units ('' is the root)."""
    units = [name for name, module in model.named_modules()
             if isinstance(module, (FSDPModule, FSDP))]
    return [name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module",
                                                              "")
            for name in units]


def describe_layout(model) -> list[dict]:
    """Every parameter's global shape and this rank's local piece of it."""
    rows = []
    for name, param in model.named_parameters():
        name = name.replace("_fsdp_wrapped_module.", "")
        # FSDP2's parameters are DTensors: a global shape, placements, and a local
        # shard. FSDP1's (use_orig_params) are plain tensors: flat views of this
        # rank's part of a FlatParameter.
        local = param.to_local() if isinstance(param, DTensor) else param
        rows.append({"name": name, "type": type(param).__name__,
                     "shape": list(param.shape),
                     "placements": [str(p)
                                    for p in getattr(param, "placements", [])],
                     "local_shape": list(local.shape), "local_numel": local.numel()})
    return rows


# --------------------------------------------------------------------------
# Sharded checkpoints with torch.distributed.checkpoint (DCP)
# --------------------------------------------------------------------------


@dataclasses.dataclass
class PendingSave:
    """A checkpoint being written into ``staging``; it becomes ``final`` once all
    ranks are done."""

    staging: Path
    final: Path
    step: int
    started: float
    future: object = None  # dcp.async_save's future; None for a synchronous save


def checkpoint_group(args) -> dist.ProcessGroup | None:
    """A process group of its own for background saves (collective: every rank
    creates it).

    dcp.async_save coordinates the ranks with collectives from a background
    thread; on the training group they would interleave with FSDP's all-gathers
    and scramble both.
    """
    return dist.new_group(backend="gloo") if args.async_save else None


def start_save(args, model, optimizer, train_state: dict, device,
               group) -> PendingSave:
    """Collective. Every rank writes its shards; rank 0 adds train and RNG states."""
    rank = dist.get_rank()
    final = args.checkpoint_dir / f"ckpt_step{train_state['step']:08d}"
    staging = args.checkpoint_dir / f".incomplete-{final.name}"
    rng_states = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(capture_rng_state(device), rng_states, dst=0)
    if rank == 0:
        # left by a run that died while saving
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        atomic_save({**train_state, "rng": rng_states}, staging / "train_state.pt")
    dist.barrier()  # the directory exists before anyone writes into it
    # DTensor shards of the model and the optimizer state: nothing is gathered.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    pending = PendingSave(staging, final, train_state["step"], time.perf_counter())
    if args.async_save:
        # Copies the shards to host memory, then writes them from a background
        # thread.
        pending.future = dcp.async_save(state, checkpoint_id=staging,
                                        process_group=group)
    else:
        dcp.save(state, checkpoint_id=staging)
    return pending


def finish_save(pending: PendingSave, keep: int) -> float:
    """Collective. Wait until every rank's shards are on disk, then publish them."""
    if pending.future is not None:
        pending.future.result()
    dist.barrier()
    if dist.get_rank() == 0:
        # A directory named ckpt_step* is complete; a crash at any moment leaves at
        # most an .incomplete-* directory behind.
        os.replace(pending.staging, pending.final)
        fsync_directory(pending.final.parent)
        for old in checkpoint_paths(pending.final.parent, "ckpt_step*")[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return time.perf_counter() - pending.started


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def newest_checkpoint(ckpt_dir: Path) -> str | None:
    """Collective. Rank 0 picks the newest complete checkpoint and tells every
    rank."""
    choice = [None, None]
    if dist.get_rank() == 0:
        candidates = checkpoint_paths(ckpt_dir, "ckpt_step*")
        found = newest_loadable([c / "train_state.pt" for c in candidates],
                                TRAIN_STATE_KEYS)
        problem = None
        if candidates and found is None:
            problem = f"none of the {len(candidates)} checkpoint(s) in {ckpt_dir} can be read"
        choice = [str(found.parent) if found else None, problem]
    dist.broadcast_object_list(choice, src=0)
    path, problem = choice
    if problem:
        raise ScriptError(f"{problem}; remove them or drop --resume to start over")
    return path


def resume(args, model, optimizer, meta: dict, device, metrics) -> tuple[int, int,
                                                                         int]:
    """Load the newest complete checkpoint, whatever the layout that wrote it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    path = newest_checkpoint(args.checkpoint_dir)
    if path is None:
        if rank == 0:
            print(f"--resume: nothing in {args.checkpoint_dir} yet, starting at "
                  "step 0")
        return 0, 0, 0
    train_state = torch.load(Path(path) / "train_state.pt", weights_only=True)
    saved = train_state["meta"]
    changed = [f"{k} {saved[k]} vs {meta[k]}" for k in meta
               if k not in ("world_size", "api", "sharding") and saved[k] != meta[k]]
    if changed:
        raise ScriptError(f"checkpoint {path} belongs to a different run "
                          f"(checkpoint vs now: {', '.join(changed)})")

    # Ask for this rank's shards of everything; DCP reads each stored item that
    # overlaps them, whatever the layout of the processes that wrote the checkpoint.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as err:
        raise ScriptError(f"cannot read checkpoint {path}: "
                          f"{one_line(err)}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])

    if saved["world_size"] == world_size:
        restore_rng_state(train_state["rng"][rank], device)
    elif rank == 0:
        print(f"note: checkpoint written by {saved['world_size']} processes, loaded "
              f"by {world_size}: the data order continues exactly, the per-rank RNG "
              "streams do not")
    metrics.write(event="resume", path=path, step=train_state["step"],
                  epoch=train_state["epoch"], written_by=saved["world_size"])
    if rank == 0:
        print(f"resumed from {path} at step {train_state['step']} (epoch "
              f"{train_state['epoch']}, written by {saved['world_size']} "
              "process(es))")
    return train_state["step"], train_state["epoch"], train_state["step_in_epoch"]


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def train_step(model, optimizer, micro_batches, args,
               device) -> tuple[torch.Tensor, dict | None]:
    """One optimizer step over --accum-steps micro-batches; returns this rank's
    loss and, with --grad-clip, the gradient norms it clipped by."""
    step_loss = torch.zeros((), device=device)
    for micro_step in range(args.accum_steps):
        x, y = next(micro_batches)
        # Only the last micro-batch reduce-scatters; the others accumulate full
        # gradients.
        last = micro_step == args.accum_steps - 1
        if args.api == "fsdp2":
            model.set_requires_gradient_sync(last)
            no_sync = contextlib.nullcontext()
        else:
            no_sync = contextlib.nullcontext() if last else model.no_sync()
        with no_sync:
            loss = model(x.to(device), y.to(device)) / args.accum_steps
            loss.backward()
        step_loss += loss.detach()
    norms = clip_gradients(model, args) if args.grad_clip else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss, norms


def local_norm(grads: list[torch.Tensor]) -> float:
    """The norm of this rank's pieces of the gradients, as a hand-written clip
    would compute it. FSDP1's gradients (use_orig_params) are such pieces."""
    return torch.linalg.vector_norm(torch.stack([
        torch.linalg.vector_norm(g.to_local() if isinstance(g, DTensor) else g)
        for g in grads])).item()


def clip_gradients(model, args) -> dict:
    """Collective. Clip by the whole gradient's norm; return it, and this rank's
    shards' norm before and after the clip."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = local_norm(grads)  # the pitfall: what a per-rank clip would use
    if args.api == "fsdp2":
        # DTensor gradients: the returned norm is a DTensor too, a partial value that
        # full_tensor() reduces across the mesh to the same number on every rank.
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        total = total.full_tensor()
    else:
        # Plain tensors: torch.nn.utils would clip each rank by its own shard's norm.
        total = model.clip_grad_norm_(args.grad_clip)
    return {"total": total.item(), "local": local,
            "local_clipped": local_norm(grads)}


def record_norms(metrics, step: int, norms: dict, max_norm: float) -> None:
    """Collective. Rank 0 writes the norm clipped by and every rank's local ones,
    before and after the clip."""
    local = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((norms["local"], norms["local_clipped"]), local, dst=0)
    metrics.write(event="grad_norm", step=step, total=norms["total"],
                  local_by_rank=[before for before, _ in local or []],
                  clipped_by_rank=[after for _, after in local or []],
                  max_norm=max_norm)


def record_compile(metrics) -> None:
    """What torch.compile did in this process: graphs compiled, graph breaks."""
    counters = torch._dynamo.utils.counters
    metrics.write(event="compile", unique_graphs=counters["stats"]["unique_graphs"],
                  graph_breaks=dict(counters["graph_break"]))


def record_collectives(metrics, log: CollectiveLog) -> None:
    """Rank 0 writes the first step's collectives; every rank reports which
    groups it used."""
    groups = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(sorted({tuple(e["group"]) for e in log.collectives()}),
                       groups, dst=0)
    metrics.write(event="collectives", step=1, events=log.events,
                  summary=log.summary(),
                  groups_by_rank=groups)


def summarize(args, model, metrics, step: int, progress: Progress, device) -> None:
    """Gather the full weights (a collective), fingerprint them, and write the
    run's last record."""
    # Every rank takes part in the gather; with cpu_offload only rank 0 ends up
    # holding the result. (Not on a CPU-only machine with FSDP1, whose offloading
    # path crashes there in torch 2.13.)
    offload = device.type == "cuda" or args.api == "fsdp2"
    full = get_model_state_dict(model,
                                options=StateDictOptions(full_state_dict=True,
                                                         cpu_offload=offload))
    if dist.get_rank() != 0:
        return
    fingerprint = state_dict_fingerprint(full)
    if args.save_final:
        args.save_final.parent.mkdir(parents=True, exist_ok=True)
        atomic_save(full, args.save_final)
    seconds, losses, steps_this_run = progress.train_seconds(), progress.losses, progress.steps_this_run
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    metrics.write(event="summary", steps=step, steps_this_run=steps_this_run,
                  first_loss=losses[0] if losses else None,
                  final_loss=losses[-1] if losses else None,
                  train_s=seconds,
                  step_time_s=seconds / steps_this_run if steps_this_run else None,
                  samples_per_s=steps_this_run * progress.global_batch / seconds
                  if steps_this_run else None,
                  peak_memory_bytes=peak, **fingerprint)
    shown = round(losses[-1], 4) if losses else None
    print(f"done: step {step}, loss {shown}, {seconds:.1f} s, weights sha256 "
          f"{fingerprint['weights_sha256'][:12]}")


def main() -> None:
    args = parse_args()
    fill_in_launch_variables()
    backend, device = choose_backend(args.backend)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = MODEL_SIZES[args.model]
    dataset = corpus_windows(args.corpus_tokens, cfg.vocab_size, cfg.context,
                             args.seed)
    check_inputs(args, world_size, int(os.environ["LOCAL_WORLD_SIZE"]), len(dataset),
                 device.type == "cuda")
    global_batch = world_size * args.batch_size * args.accum_steps
    steps_per_epoch = len(dataset) // global_batch
    total_steps = args.max_steps or args.epochs * steps_per_epoch

    dist.init_process_group(backend=backend, init_method="env://",
                            device_id=process_group_device(device))
    metrics = open_metrics(args.metrics, backend, device)
    mesh = build_mesh(args, world_size, device)
    sharding = args.sharding
    if args.api == "fsdp1" and world_size == 1 and args.sharding != "no_shard":
        # One process has no one to shard with: FSDP1 runs as NO_SHARD, and warns so
        # at wrapping and again at every state dict. The start-up line says it once.
        warnings.filterwarnings("ignore", "FSDP is switching to use `NO_SHARD`")
        warnings.filterwarnings("ignore", "When using ``NO_SHARD`` for ``ShardingStrategy``")
        sharding = f"{args.sharding}, run as no_shard on one process"
    model, optimizer, n_params = build_model(args, device, rank, mesh)
    loader = rank_loader(dataset, args.batch_size, rank, world_size, args.seed)

    meta = {"model": args.model, "seed": args.seed,
            "corpus_tokens": args.corpus_tokens,
            "mixed_precision": args.mixed_precision, "global_batch": global_batch,
            "world_size": world_size, "api": args.api, "sharding": args.sharding}
    step, start_epoch, start_step_in_epoch = 0, 0, 0
    if args.resume:
        step, start_epoch, start_step_in_epoch = resume(args, model, optimizer, meta,
                                                        device, metrics)

    local_params = [None] * world_size if rank == 0 else None
    dist.gather_object(sum(row["local_numel"] for row in describe_layout(model)),
                       local_params, dst=0)
    layouts = [None] * world_size if rank == 0 else None
    dist.gather_object(describe_layout(model), layouts, dst=0)
    metrics.write(event="config",
                  **{k: str(v) if isinstance(v, Path) else v
                     for k, v in vars(args).items()},
                  params=n_params, local_params=local_params,
                  global_batch=global_batch,
                  steps_per_epoch=steps_per_epoch, total_steps=total_steps,
                  mesh={"shape": list(mesh.shape),
                        "dims": list(mesh.mesh_dim_names)},
                  units=describe_units(model))
    metrics.write(event="layout", ranks=layouts)
    if rank == 0:
        print(f"GPT-{args.model} ({n_params:,} parameters) with {args.api}, "
              f"sharding {sharding}, on {world_size} process(es) as mesh "
              f"{tuple(mesh.shape)}, {backend}/{device.type}; global batch "
              f"{world_size} x {args.batch_size} x {args.accum_steps} = "
              f"{global_batch}; {steps_per_epoch} steps/epoch, training to step "
              f"{total_steps}", flush=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    progress = Progress(args.log_every, total_steps, global_batch, metrics,
                        args.print_every)
    save_group, pending = checkpoint_group(args), None
    model.train()
    for epoch in range(start_epoch, math.ceil(total_steps / steps_per_epoch)):
        loader.sampler.set_epoch(epoch)
        skip = start_step_in_epoch if epoch == start_epoch else 0
        micro_batches = itertools.islice(iter(loader), skip * args.accum_steps, None)
        for step_in_epoch in range(skip, steps_per_epoch):
            if step >= total_steps:
                break
            if args.count_comm and progress.steps_this_run == 0:
                marks = {f"blocks.{i}": block
                         for i, block in enumerate(model.blocks)}
                with CollectiveLog(marks) as log:
                    step_loss, norms = train_step(model, optimizer, micro_batches,
                                                  args, device)
                record_collectives(metrics, log)
            else:
                step_loss, norms = train_step(model, optimizer, micro_batches, args,
                                              device)
            step += 1
            if norms is not None:
                record_norms(metrics, step, norms, args.grad_clip)
            progress.step_done(step, epoch, step_loss)
            if args.checkpoint_dir and (step % args.save_every == 0 or step
                                        == total_steps):
                saved_at = time.perf_counter()
                # the previous asynchronous save must be published first
                if pending is not None:
                    finish_save(pending, args.keep)
                train_state = {"step": step, "epoch": epoch,
                               "step_in_epoch": step_in_epoch + 1,
                               "meta": meta}
                pending = start_save(args, model, optimizer, train_state, device,
                                     save_group)
                blocking = time.perf_counter() - pending.started
                if not args.async_save:
                    finish_save(pending, args.keep)
                    pending = None
                seconds = progress.exclude_since(saved_at)
                metrics.write(event="checkpoint", step=step, seconds=seconds,
                              blocking_s=blocking,
                              asynchronous=args.async_save)
            if step == args.crash_at_step and rank == args.crash_rank:
                sys.stderr.write(f"[rank {rank}] fault injection: SIGKILL after "
                                 f"step {step}\n")
                os.kill(os.getpid(), signal.SIGKILL)

    if pending is not None:
        finish_save(pending, args.keep)
    summarize(args, model, metrics, step, progress, device)
    if args.compile != "off":
        record_compile(metrics)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
