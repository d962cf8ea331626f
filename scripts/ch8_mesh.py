"""Meshes that combine parallelisms: FSDP x tensor parallel, pipeline x FSDP x tensor parallel.

    torchrun --standalone --nproc_per_node=4 scripts/ch8_mesh.py                 # dp 2 x tp 2
    torchrun --standalone --nproc_per_node=8 scripts/ch8_mesh.py --pp 2          # 2 x 2 x 2
    torchrun --standalone --nproc_per_node=4 scripts/ch8_mesh.py --relayout runs/dcp

The processes form a DeviceMesh, one named dimension per kind of parallelism, rank-major:
(dp, tp), or (pp, dp, tp) with --pp 2. Each dimension's sub-mesh is a process group: the
ranks that differ only in their tp coordinate split every block's heads and hidden units
(section 8.2's plan, parallelize_module on mesh["tp"]); those that differ only in their dp
coordinate see different slices of the batch and shard what tensor parallelism left them
(fully_shard on mesh["dp"]); those that differ only in their pp coordinate hold consecutive
stages of the model (section 8.3's Stage, run by ScheduleGPipe over mesh["pp"]).

The script trains the book's GPT --steps steps on the mesh, every dp rank on its own slice of
the global batch, and one process trains the whole global batch (the reference). It records
the relative gap of the final weights to the reference, and two controls that must fail: the
mesh with every dp rank fed the same slice (the batch is not split), and one process stopped a
step early. It records each rank's place in the mesh and the placements of one parameter.

--relayout DIR moves a checkpoint between layouts with torch.distributed.checkpoint: FSDP over
all processes trains and saves (dcp.save of get_state_dict), an FSDP x TP model loads it
(dcp.load, set_state_dict) and saves it again, and an FSDP-only model loads that. Each load is
compared with the saved weights, gathered whole (full_tensor), for equality; the controls load
the checkpoint of the step before, and load into FSDP x TP without restoring the qkv row order
that section 8.2's plan needs.
"""

import argparse
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor, distribute_tensor

from dtbook.cli import (
    ScriptError,
    add_backend_and_metrics,
    positive_float,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.compare import training_gap
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES
from dtbook.pipeline import Stage, loss_fn
from dtbook.tensor_parallel import dtensor_parallel, heads_in_model_order, shard

# full_tensor() of a (_StridedShard, Shard) parameter gathers over dp, then over tp, and
# DTensor logs on every rank that one all-gather would be faster: true, and not the lesson.
logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
    lambda record: "sequential all_gather" not in record.getMessage())

PROBE = "blocks.0.qkv.weight"  # the parameter whose placements the run reports
LAYOUT = {"pp": "PP", "dp": "FSDP", "tp": "TP"}  # what each mesh dimension does


def build_mesh(device: torch.device, pp: int, dp: int, tp: int) -> DeviceMesh:
    """Rank r sits at (r // tp % dp, r % tp): tp is the fastest-varying one."""
    if pp == 1:
        return init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device.type, (pp, dp, tp),
                            mesh_dim_names=("pp", "dp", "tp"))


def build_model(cfg, mesh: DeviceMesh, seed: int) -> Stage:
    """This rank's part of the GPT: tensor parallel on mesh["tp"], then sharded
    on mesh["dp"].

    Every rank builds the whole GPT from the same seed; a pipeline rank keeps its
    stage's blocks (with pp 1 the one stage is the whole model, its head tied to
    the embedding)."""
    torch.manual_seed(seed)
    gpt = GPT(cfg).to(mesh.device_type)
    if mesh["tp"].size() > 1:
        dtensor_parallel(gpt, mesh["tp"])  # section 8.2's plan, on this tp group
    pp, stage_index = pipeline_position(mesh)
    per = cfg.n_layer // pp
    stage = Stage(gpt, stage_index * per, (stage_index + 1) * per)
    for block in stage.blocks.values():
        fully_shard(block, mesh=mesh["dp"])  # shards what tp left this rank, over dp
    fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=False)
    return stage


def pipeline_position(mesh: DeviceMesh) -> tuple[int, int]:
    """(stages, this rank's stage): (1, 0) on a mesh without a pp dimension."""
    if "pp" not in mesh.mesh_dim_names:
        return 1, 0
    return mesh["pp"].size(), mesh.get_local_rank("pp")


def tied_weight_group(mesh: DeviceMesh):
    """The group of this rank's first-stage and last-stage peers (same dp and tp
    coordinates), which add the gradients of the embedding and the tied head."""
    if "pp" not in mesh.mesh_dim_names:
        return None
    ranks = mesh.mesh  # (pp, dp, tp) -> global rank
    mine = None
    for d in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            pair = [ranks[0, d, t].item(), ranks[-1, d, t].item()]
            group = dist.new_group(pair)  # every rank creates every group, in order
            if dist.get_rank() in pair:
                mine = group
    return mine


def add_tied_gradients(stage: Stage, group) -> None:
    """One process adds the embedding's and the head's gradients in one tensor; here the
    first and the last stage hold a copy each, sharded the same way over dp: add the shards."""
    if group is None:
        return
    weight = stage.tok_emb.weight if stage.is_first else stage.head.weight
    dist.all_reduce(weight.grad.to_local(), group=group)


def train(cfg, mesh: DeviceMesh, batches, args, device) -> Stage:
    """--steps AdamW steps; ``batches``: this rank's dp slice, step by step."""
    stage = build_model(cfg, mesh, args.seed)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr)
    pp, stage_index = pipeline_position(mesh)
    if pp > 1:
        pipe = PipelineStage(stage, stage_index, pp, device,
                             group=mesh["pp"].get_group())
        schedule = ScheduleGPipe(pipe, args.microbatches, loss_fn=loss_fn)
        tied = tied_weight_group(mesh)
    for x, y in batches:
        if pp == 1:
            loss_fn(stage(x), y).backward()  # FSDP reduce-scatters over dp
        elif stage.is_first:
            schedule.step(x)
        else:
            schedule.step(target=y)
        if pp > 1:
            add_tied_gradients(stage, tied)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return stage


def full_weights(model, tp: int) -> dict[str, torch.Tensor]:
    """Collective over the model's mesh: every parameter gathered whole, in one process's
    layout (qkv rows back in [q | k | v] order); the tied head is the embedding."""
    weights = {}
    for name, param in model.named_parameters():
        if name == "head.weight":
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
        full = full.cpu()  # compared on rank 0, whatever the device
        weights[name] = heads_in_model_order(full, tp) if ".qkv." in name else full
    return weights


def gather_weights(stage: Stage, mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """Every stage's weights, on rank 0 (other ranks get an empty dict)."""
    weights = full_weights(stage, mesh["tp"].size())
    first_of_stage = mesh.get_local_rank("dp") == 0 and mesh.get_local_rank("tp") == 0
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, weights if first_of_stage else {})
    return {name: w for part in parts for name, w in part.items()}


def reference_training(cfg, dp_batches, args) -> list[dict[str, torch.Tensor]]:
    """One process, the whole global batch (every dp slice) each step: its weights after
    every step."""
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(dp_batches[0][0][0].device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    snapshots = []
    for step_batches in zip(*dp_batches, strict=True):
        x = torch.cat([b[0] for b in step_batches])
        y = torch.cat([b[1] for b in step_batches])
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        snapshots.append({n: p.detach().clone().cpu()
                          for n, p in model.named_parameters()})
    return snapshots


def describe_ranks(mesh: DeviceMesh, stage: Stage) -> dict:
    """This rank's coordinates, its groups along every mesh dimension, and which contiguous
    chunk of the probe parameter's rows it holds (counted in dp x tp chunks)."""
    row = {"rank": dist.get_rank(), "coordinate": mesh.get_coordinate()}
    for dim in mesh.mesh_dim_names:
        row[f"{dim}_group"] = mesh[dim].mesh.tolist()
    params = dict(stage.named_parameters())
    if PROBE in params:
        probe = params[PROBE]
        full, local = probe.full_tensor(), probe.to_local()
        chunks = full.chunk(full.shape[0] // local.shape[0])
        row["probe_chunk"] = next(i for i, c in enumerate(chunks) if torch.equal(c, local))
    return row


def placements(model, layout: str) -> dict:
    """How the probe parameter is laid out, as DTensor reports it."""
    param = dict(model.named_parameters())[PROBE]
    return {"layout": layout, "param": PROBE, "mesh": list(param.device_mesh.mesh_dim_names),
            "mesh_shape": list(param.device_mesh.shape), "placements": repr(param.placements),
            "shape": list(param.shape), "local_shape": list(param.to_local().shape)}


# --------------------------------------------------------------------------
# Checkpoints moved between layouts (--relayout)
# --------------------------------------------------------------------------


def qkv_entries(state, path: str = ""):
    """(container, key, path) of every qkv tensor in a nested model/optimizer state dict."""
    for key, value in (state.items() if isinstance(state, dict) else enumerate(state)):
        here = f"{path}.{key}"
        if isinstance(value, (dict, list)):
            yield from qkv_entries(value, here)
        elif isinstance(value, DTensor) and ".qkv." in here:
            yield state, key, here


def regroup(tensor: DTensor, tp: int, to_model_order: bool) -> DTensor:
    """The same DTensor layout over a qkv tensor whose rows are permuted: to one process's
    order for a checkpoint, or back to rank-grouped order for section 8.2's plan."""
    full = tensor.full_tensor()
    if to_model_order:
        full = heads_in_model_order(full, tp)
    else:
        full = torch.cat([shard(full, 0, 3, r, tp) for r in range(tp)])
    return distribute_tensor(full, tensor.device_mesh, tensor.placements)


def save(model, optimizer, path: Path, tp: int) -> None:
    """Every rank writes its own shards; qkv rows are saved in one process's order."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    if tp > 1:
        for container, key, _ in list(qkv_entries(state)):
            container[key] = regroup(container[key], tp, to_model_order=True)
    dcp.save(state, checkpoint_id=path)


def load(model, optimizer, path: Path, tp: int, fix_rows: bool = True) -> None:
    """Each rank reads the pieces of the checkpoint that overlap its own shards,
    whatever layout wrote them; qkv rows are then regrouped by tp rank
    (``fix_rows`` False: the control)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=path)
    if tp > 1 and fix_rows:
        for container, key, _ in list(qkv_entries(state)):
            container[key].to_local().copy_(
                regroup(container[key], tp, to_model_order=False).to_local())
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def fsdp_model(cfg, mesh: DeviceMesh, seed: int, lr: float):
    """``build_model`` on a mesh, with its optimizer; a seed of its own for every model, so
    that only a load can make two of them equal."""
    model = build_model(cfg, mesh, seed)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def relayout(cfg, args, device, metrics) -> None:
    """FSDP (all ranks) -> checkpoint -> FSDP x TP -> checkpoint -> FSDP, weights compared."""
    world, tp = dist.get_world_size(), args.tp
    flat = init_device_mesh(device.type, (world, 1), mesh_dim_names=("dp", "tp"))
    grid = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    dataset = corpus_windows(args.corpus_tokens, cfg.vocab_size, cfg.context, args.seed)
    batches = first_batches(dataset, args.batch_size, dist.get_rank(), world, args.seed,
                            args.steps, device)
    model, optimizer = fsdp_model(cfg, flat, args.seed, args.lr)
    ckpt = {name: args.relayout / name for name in ("fsdp_before", "fsdp", "fsdp_x_tp")}
    for step, (x, y) in enumerate(batches, 1):
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.steps - 1:  # the last two steps: the checkpoint and the control's
            save(model, optimizer, ckpt["fsdp" if step == args.steps else "fsdp_before"], 1)
    saved = full_weights(model, 1)
    rows = [placements(model, "FSDP")]

    def compare(move: str, loaded, tp_: int, control: bool) -> None:
        weights = full_weights(loaded, tp_)
        equal = all(torch.equal(weights[n], saved[n]) for n in saved)
        metrics.write(event="relayout", move=move, control=control, equal=equal,
                      gap=training_gap(weights, saved))

    grid_model, grid_optim = fsdp_model(cfg, grid, args.seed + 1, args.lr)
    rows.append(placements(grid_model, "FSDP x TP"))
    load(grid_model, grid_optim, ckpt["fsdp"], tp)
    compare("FSDP -> FSDP x TP", grid_model, tp, False)
    save(grid_model, grid_optim, ckpt["fsdp_x_tp"], tp)
    back, back_optim = fsdp_model(cfg, flat, args.seed + 2, args.lr)
    load(back, back_optim, ckpt["fsdp_x_tp"], 1)
    compare("FSDP x TP -> FSDP", back, 1, False)

    # The controls load into the FSDP x TP model that holds the right weights already:
    # a load that changed nothing would pass them.
    load(grid_model, grid_optim, ckpt["fsdp_before"], tp)
    compare("control: the step before", grid_model, tp, True)
    load(grid_model, grid_optim, ckpt["fsdp"], tp, fix_rows=False)
    compare("control: qkv rows not regrouped", grid_model, tp, True)
    for row in rows:
        metrics.write(event="placements", **row)


# --------------------------------------------------------------------------
# The program
# --------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="tiny",
                        help="model size (default: tiny)")
    parser.add_argument("--tp", type=positive_int, default=2,
                        help="tensor-parallel degree (default: 2)")
    parser.add_argument("--pp", type=positive_int, default=1,
                        help="pipeline stages (default: 1, a 2-D mesh)")
    parser.add_argument("--dp", type=positive_int,
                        help="data-parallel degree (default: processes / (pp x tp))")
    parser.add_argument("--steps", type=positive_int, default=4,
                        help="optimizer steps (default: 4)")
    parser.add_argument("--batch-size", type=positive_int, default=4,
                        help="windows per dp rank per step (default: 4)")
    parser.add_argument("--microbatches", type=positive_int, default=2,
                        help="micro-batches per step with --pp 2 or more (default: 2)")
    parser.add_argument("--lr", type=positive_float, default=DEFAULTS.lr)
    parser.add_argument("--corpus-tokens", type=positive_int, default=20_000,
                        help="length of the synthetic corpus (default: 20000)")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--relayout", type=Path, metavar="DIR",
                        help="also move a DCP checkpoint FSDP -> FSDP x TP -> FSDP in DIR")
    add_backend_and_metrics(parser)
    return parser.parse_args(argv)


def check_inputs(args: argparse.Namespace, world: int) -> None:
    """Refuse a mesh that does not fit the processes or the model, in one line."""
    cfg = MODEL_SIZES[args.model]
    if args.dp is None:
        if world % (args.pp * args.tp):
            raise ScriptError(f"{world} processes do not split into pp {args.pp} x tp "
                              f"{args.tp}: start a multiple of {args.pp * args.tp}")
        args.dp = world // (args.pp * args.tp)
    if args.pp * args.dp * args.tp != world:
        raise ScriptError(f"the mesh pp {args.pp} x dp {args.dp} x tp {args.tp} holds "
                          f"{args.pp * args.dp * args.tp} processes, but the world has {world}: "
                          "a mesh must cover the world exactly")
    if cfg.n_head % args.tp:
        raise ScriptError(f"the {args.model} model's {cfg.n_head} attention heads do not "
                          f"split over tp {args.tp}")
    if cfg.n_layer % args.pp:
        raise ScriptError(f"the {args.model} model's {cfg.n_layer} blocks do not split into "
                          f"{args.pp} stages")
    if args.pp > 1 and args.batch_size % args.microbatches:
        raise ScriptError(f"--batch-size {args.batch_size} does not split into "
                          f"{args.microbatches} micro-batches")
    windows = (args.corpus_tokens - 1) // cfg.context
    if windows < world * args.batch_size * args.steps:
        raise ScriptError(f"--steps {args.steps} x {world} processes x --batch-size "
                          f"{args.batch_size} need more windows than the corpus's {windows}: "
                          "raise --corpus-tokens")
    if args.relayout and (args.pp > 1 or args.tp == 1):
        raise ScriptError("--relayout moves a checkpoint between FSDP and FSDP x TP: it needs "
                          "--pp 1 and --tp 2 or more")
    if args.relayout and args.steps < 2:
        raise ScriptError("--relayout saves the last two steps (its control loads the earlier "
                          "one): use --steps 2 or more")


def main() -> None:
    args = parse_args()
    check_inputs(args, int(os.environ.get("WORLD_SIZE", 1)))  # every rank fails fast
    backend, device = start_process_group(args.backend)
    metrics = open_metrics(args.metrics, backend, device)
    rank, cfg = dist.get_rank(), MODEL_SIZES[args.model]
    mesh = build_mesh(device, args.pp, args.dp, args.tp)
    dataset = corpus_windows(args.corpus_tokens, cfg.vocab_size, cfg.context, args.seed)
    # The dp ranks split the global batch; every rank of a dp slice (its tp and pp
    # peers) sees the same windows.
    dp_batches = [first_batches(dataset, args.batch_size, d, args.dp, args.seed, args.steps,
                                device) for d in range(args.dp)]
    dp_rank = mesh.get_local_rank("dp")
    runs = {"mesh": dp_batches[dp_rank], "control: dp ranks share a slice": dp_batches[0]}
    weights = {}
    for name, batches in runs.items():
        stage = train(cfg, mesh, batches, args, device)
        weights[name] = gather_weights(stage, mesh)
        if name == "mesh":
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, describe_ranks(mesh, stage))
            if PROBE in dict(stage.named_parameters()):  # rank 0's stage has it
                layout = placements(stage, " x ".join(LAYOUT[d] for d in mesh.mesh_dim_names))
    if rank == 0:
        snapshots = reference_training(cfg, dp_batches, args)
        reference = snapshots[-1]
        gaps = {name: training_gap(w, reference) for name, w in weights.items()}
        if args.steps > 1:
            gaps["control: one process, a step fewer"] = training_gap(snapshots[-2], reference)
        metrics.write(event="mesh", shape=list(mesh.shape), dims=list(mesh.mesh_dim_names),
                      ranks=ranks, steps=args.steps, global_batch=args.dp * args.batch_size)
        metrics.write(event="placements", **layout)
        gap = gaps.pop("mesh")
        metrics.write(event="compare", steps=args.steps, runs={"mesh": gap}, controls=gaps)
        shape = " x ".join(f"{d} {n}" for d, n in zip(mesh.mesh_dim_names, mesh.shape,
                                                      strict=True))
        print(f"mesh {shape}, {args.steps} steps: relative gap to one process {gap:.1e}; "
              + "; ".join(f"{name} {g:.1e}" for name, g in gaps.items()))
    if args.relayout:
        relayout(cfg, args, device, metrics)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
