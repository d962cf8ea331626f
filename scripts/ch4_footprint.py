"""What one training step keeps in memory and sends over the network, per rank, for
DDP and FSDP.

    torchrun --standalone --nproc_per_node=2 scripts/ch4_footprint.py
    torchrun --standalone --nproc_per_node=4 scripts/ch4_footprint.py --configs ddp fsdp2_full
    python scripts/ch4_footprint.py                  # a world of one

For every configuration the script builds the book's GPT, wraps it, and runs two
optimizer steps (AdamW) on the same batches: the first allocates the optimizer state,
the second is measured. It records, on every rank:

- the bytes of parameters, gradients and optimizer state this rank holds (counted
  tensor by tensor, by the memory behind them, so FSDP's padding counts too), next to
  the ZeRO formula;
- the live bytes between steps and the peak during the measured step. On a GPU that
  is torch.cuda.max_memory_allocated; on the CPU, which has no such counter,
  LiveMemory below watches every tensor allocated from the start of the
  configuration's construction;
- every collective of the measured step (CollectiveLog), with its process group and
  size;
- how far the weights after the two steps are from DDP's (the first configuration,
  when it is ddp), and, as a control, how far DDP's own weights after one step are
  from those after two.

Configurations: ddp, zero1 (DDP + ZeroRedundancyOptimizer), fsdp2_full, fsdp2_grad_op
(reshard_after_forward=False), fsdp2_root_only (one FSDP unit for the whole model),
fsdp2_full_ac (with activation checkpointing), fsdp2_hybrid (shard groups of 2; needs
an even world of 4 or more), fsdp2_offload (CUDA only: there is no device memory to
offload on a CPU-only machine), fsdp1_full, fsdp1_grad_op, fsdp1_no_shard.
"""

import argparse
import gc
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, ShardingStrategy, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.collectives import CollectiveLog
from dtbook.compare import same_training, training_gap
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES, Block

# Two optimizer steps per configuration: the control is DDP after the first.
TRAINED_STEPS = 2
CONFIGS = ["ddp", "zero1", "fsdp2_full", "fsdp2_grad_op", "fsdp2_root_only",
           "fsdp2_full_ac", "fsdp2_hybrid",
           "fsdp2_offload", "fsdp1_full", "fsdp1_grad_op", "fsdp1_no_shard"]
HOST = torch.device("cpu")
FSDP1_STRATEGIES = {"full": ShardingStrategy.FULL_SHARD,
                    "grad_op": ShardingStrategy.SHARD_GRAD_OP,
                    "no_shard": ShardingStrategy.NO_SHARD}
# NO_SHARD is measured on purpose, as FSDP1's stand-in for DDP. torch deprecates it
# (use DDP) with two warnings per rank and per call, which would bury the table the
# page reads.
warnings.filterwarnings("ignore",
                        message="The `NO_SHARD` sharding strategy is deprecated")
warnings.filterwarnings("ignore",
                        message="When using ``NO_SHARD`` for ``ShardingStrategy``")


class LiveMemory(TorchDispatchMode):
    """Bytes held on ``device`` by tensors allocated while active: now, and the
    peak since reset_peak.

    Only storages on the training device count: with CPU offload on a GPU, the
    shards in host memory are what left the device (on an H100 they once counted
    as device memory, and offload's peak equalled full sharding's). Each
    operator's outputs are registered by their storage; a weak reference drops a
    storage when it is freed. FSDP frees and re-allocates gathered parameters by
    resizing their storage, without an operator, so the total is re-read after
    every operator rather than kept as a running sum. ``on_peak``, if set, is
    called with the operator each time the peak rises; what it returns is kept in
    ``at_peak``.
    """

    def __init__(self, device: torch.device):
        super().__init__()
        self.device_type = device.type
        self.storages: dict[int, weakref.ref] = {}
        self.peak = 0
        self.on_peak = None
        self.at_peak = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            self._track(tensor)
        live = self.live()
        if live > self.peak:
            self.peak = live
            if self.on_peak is not None:
                self.at_peak = self.on_peak(func)
        return out

    def _track(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        # a DTensor: memory is in its local part
        if is_traceable_wrapper_subclass(tensor):
            for name in tensor.__tensor_flatten__()[0]:
                self._track(getattr(tensor, name))
            return
        storage = tensor.untyped_storage()
        if storage.device.type != self.device_type:
            return
        key = id(storage)
        if key not in self.storages:
            forget = lambda _, key=key: self.storages.pop(key, None)
            self.storages[key] = weakref.ref(storage, forget)

    def live(self) -> int:
        alive = (ref() for ref in list(self.storages.values()))
        return sum(storage.nbytes() for storage in alive if storage is not None)

    def reset_peak(self) -> None:
        self.peak = self.live()


def storage_bytes(tensors, device: torch.device) -> int:
    """Bytes of memory on ``device``'s kind behind some tensors, each storage
    counted once (views share one)."""
    seen = {}
    for tensor in tensors:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        if storage.device.type == device.type:
            seen[storage.data_ptr(), storage.device] = storage.nbytes()
    return sum(seen.values())


def optimizer_moments(optimizer) -> list[torch.Tensor]:
    """AdamW's two running averages per parameter (its 4-byte step counters are
    left out)."""
    inner = optimizer.optim if isinstance(optimizer,
                                          ZeroRedundancyOptimizer) else optimizer
    return [state[key] for state in inner.state.values()
            for key in ("exp_avg", "exp_avg_sq")]


def build(config: str, cfg, device: torch.device, seed: int, lr: float):
    """The wrapped model and its optimizer for one configuration."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    api, _, variant = config.partition("_")
    if config in ("ddp", "zero1"):
        model = DDP(model, device_ids=ddp_device_ids(device))
    elif api == "fsdp2":
        mesh = None
        if variant == "hybrid":
            mesh = init_device_mesh(device.type, (dist.get_world_size() // 2, 2),
                                    mesh_dim_names=("replicate", "shard"))
        offload = {"offload_policy": CPUOffloadPolicy()} if variant == "offload" else {}
        if variant == "full_ac":
            for block in model.blocks:
                forward = block.forward
                block.forward = lambda x, forward=forward: checkpoint(
                    forward, x, use_reentrant=False)
        if variant != "root_only":
            for block in model.blocks:
                fully_shard(block, mesh=mesh,
                            reshard_after_forward=variant != "grad_op", **offload)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, **offload)
    else:
        model = FSDP(model, sharding_strategy=FSDP1_STRATEGIES[variant],
                     auto_wrap_policy=ModuleWrapPolicy({Block}),
                     device_id=device, use_orig_params=True)
    if config == "zero1":
        optimizer = ZeroRedundancyOptimizer(model.parameters(),
                                            optimizer_class=torch.optim.AdamW, lr=lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, optimizer


def fsdp_units_now(model, marks: dict) -> dict | None:
    """Each FSDP2 unit's state (FSDPParam.sharded_state: UNSHARDED means gathered) and
    training state (FORWARD, PRE_BACKWARD, ...) at this moment; None for other APIs."""
    units = {"root": model, **marks}
    units = {name: m for name, m in units.items() if isinstance(m, FSDPModule)}
    if not units:
        return None
    states = {}
    for name, unit in units.items():
        group = unit._get_fsdp_state()._fsdp_param_group
        states[name] = {"sharded_state": group.fsdp_params[0].sharded_state.name,
                        "training_state": group._training_state.name}
    return states


def formula(config: str, n_params: int, world_size: int) -> dict[str, float]:
    """ZeRO's per-rank bytes with fp32 weights and AdamW: 4 (weights) + 4
    (gradients) + 8 (two moments) bytes per parameter, each divided by the number
    of ranks that share it."""
    shards = {"ddp": 1, "zero1": 1, "fsdp1_no_shard": 1,
              "fsdp2_hybrid": 2}.get(config, world_size)
    optimizer_shards = world_size if config == "zero1" else shards
    return {"params": 4 * n_params / shards, "grads": 4 * n_params / shards,
            "optimizer": 8 * n_params / optimizer_shards}


def measure(config: str, cfg, device, batches, args) -> dict:
    """Build under LiveMemory, take a warm-up step, then measure one step."""
    with LiveMemory(device) as memory:
        model, optimizer = build(config, cfg, device, args.seed, args.lr)
        (x1, y1), (x2, y2) = batches
        model(x1, y1).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after_one_step = full_weights(model) if config == "ddp" else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        memory.reset_peak()
        inner = model.module if isinstance(model, DDP) else model
        marks = {f"blocks.{i}": block for i, block in enumerate(inner.blocks)}
        # which units are gathered when the peak is reached, and by which operator
        memory.on_peak = lambda func: {"op": str(func),
                                       "units": fsdp_units_now(inner, marks)}
        with CollectiveLog(marks) as log:
            model(x2, y2).backward()
            with_grad = [p for p in model.parameters() if p.grad is not None]
            grads = {where: storage_bytes((p.grad for p in with_grad), where)
                     for where in (device, HOST)}
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        on_gpu = device.type == "cuda"
        state = {"params": list(model.parameters()),
                 "optimizer": optimizer_moments(optimizer)}
        row = {"rank": dist.get_rank(),
               "params": storage_bytes(state["params"], device),
               "grads": grads[device],
               "optimizer": storage_bytes(state["optimizer"], device),
               # in host memory, apart from the device's: CPU offload's shards
               "host": None if device == HOST else {
                   "params": storage_bytes(state["params"], HOST),
                   "grads": grads[HOST],
                   "optimizer": storage_bytes(state["optimizer"], HOST)},
               "at_rest": memory.live(),
               "peak_step": memory.peak,
               "at_peak": memory.at_peak,
               "cuda_peak_step": torch.cuda.max_memory_allocated() if on_gpu
               else None}
    layout = None
    if config == "fsdp2_full":
        layout = [{"name": n, "shape": list(p.shape),
                   "placements": [str(q) for q in p.placements],
                   "local_shape": list(p.to_local().shape),
                   "device_mesh": str(p.device_mesh)}
                  for n, p in model.named_parameters()]
    weights = full_weights(model)
    del model, optimizer
    gc.collect()
    return {"row": row, "log": log, "layout": layout, "weights": weights,
            "after_one_step": after_one_step}


def check_offload(row: dict) -> None:
    """CPUOffloadPolicy moves the sharded parameters and the AdamW state to host
    memory: the device must hold none of them after the step, and the host all of
    them."""
    host = row["host"]
    if row["params"] or row["optimizer"] or not (host["params"]
                                                 and host["optimizer"]):
        raise RuntimeError(f"fsdp2_offload left state on the device: {row}")


def full_weights(model) -> dict[str, torch.Tensor]:
    """The whole model's weights on every rank (a collective), for comparing
    configurations."""
    state = get_model_state_dict(model,
                                 options=StateDictOptions(full_state_dict=True))
    return {name: value.detach().cpu().clone() for name, value in state.items()}


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small",
                        help="model size (default: small)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, metavar="CONFIG",
                        help="what to measure (default: all that apply); any of "
                             f"{', '.join(CONFIGS)}")
    parser.add_argument("--batch-size", type=positive_int, default=8,
                        help="windows per process per step")
    parser.add_argument("--lr", type=float, default=DEFAULTS.lr)
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    add_backend_and_metrics(parser)
    return parser.parse_args()


def applicable(config: str, world_size: int, on_gpu: bool) -> bool:
    if config == "fsdp2_hybrid":
        return world_size >= 4 and world_size % 2 == 0
    if config == "fsdp2_offload":
        return on_gpu
    return True


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    configs = args.configs or [c for c in CONFIGS
                               if applicable(c, world_size, device.type == "cuda")]
    refused = [c for c in configs
               if not applicable(c, world_size, device.type == "cuda")]
    if refused:
        raise ScriptError(f"cannot measure {', '.join(refused)} here: fsdp2_hybrid "
                          "needs an even world of 4 or more processes, "
                          "fsdp2_offload a GPU")
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    dataset = corpus_windows(TRAINED_STEPS * world_size * args.batch_size
                             * cfg.context + 1, cfg.vocab_size,
                             cfg.context, args.seed)
    batches = first_batches(dataset, args.batch_size, rank, world_size, args.seed,
                            TRAINED_STEPS,
                            device)
    reference = GPT(cfg)
    n_params = sum(p.numel() for p in reference.parameters())
    units = {"root": sum(p.numel()
                         for p in [*reference.tok_emb.parameters(),
                                   *reference.pos_emb.parameters(),
                                              *reference.ln_f.parameters()]),
             "block": sum(p.numel() for p in reference.blocks[0].parameters())}
    largest = max(p.numel() for p in reference.parameters())
    metrics.write(event="model", model=args.model, params=n_params,
                  largest_param=largest,
                  unit_params=units, blocks=cfg.n_layer)

    # What lives now (the imported modules, the reference model) lives to the end: frozen,
    # it is left out of the gc.collect() after each configuration, which then walks only
    # what that configuration made.
    gc.freeze()
    ddp_weights = None
    for config in configs:
        result = measure(config, cfg, device, batches, args)
        if config == "fsdp2_offload":
            check_offload(result["row"])
        if config == "ddp":
            ddp_weights = result["weights"]
            # The control: DDP one optimizer step earlier, a model that must fail the
            # comparison.
            metrics.write(event="control", steps=TRAINED_STEPS,
                          gap_vs_ddp=training_gap(result["after_one_step"],
                                                  ddp_weights),
                          same_as_ddp=same_training(result["after_one_step"],
                                                    ddp_weights, TRAINED_STEPS))
        comparison = {}
        if ddp_weights is not None:
            comparison = {"gap_vs_ddp": training_gap(result["weights"], ddp_weights),
                          "same_as_ddp": same_training(result["weights"],
                                                       ddp_weights, TRAINED_STEPS)}
        rows = [None] * world_size
        dist.all_gather_object(rows, result["row"])
        groups = [None] * world_size
        dist.all_gather_object(groups,
                               sorted({tuple(e["group"])
                                       for e in result["log"].collectives()}))
        metrics.write(event="footprint", config=config, world_size=world_size,
                      ranks=rows, **comparison,
                      formula=formula(config, n_params, world_size),
                      collectives=result["log"].summary(),
                      timeline=result["log"].events, groups_by_rank=groups)
        if result["layout"] is not None:
            everyone = [None] * world_size
            dist.all_gather_object(everyone, result["layout"])
            metrics.write(event="layout", config=config, ranks=everyone)
        if rank == 0:
            me = rows[0]
            traffic = sum(v["traffic_bytes"]
                          for v in result["log"].summary().values())
            print(f"{config:<16} params {me['params']:>9,} B  grads "
                  f"{me['grads']:>9,} B  optimizer {me['optimizer']:>9,} B  peak "
                  f"{me['peak_step']:>10,} B  sent/step {traffic:>10,.0f} B")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
