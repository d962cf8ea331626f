"""FSDP from scratch, next to DDP and fully_shard: same data, same start, same
weights.

    torchrun --standalone --nproc_per_node=2 scripts/ch4_minimal_fsdp.py
    torchrun --standalone --nproc_per_node=2 scripts/ch4_minimal_fsdp.py --compute-dtypes bf16
    python scripts/ch4_minimal_fsdp.py            # a world of one

MinimalFSDP below does what FSDP does, in two pages. Each wrapped unit (every
transformer block, and the root for what is left) flattens its parameters into one
vector, pads it to a multiple of the world size and keeps only its own 1/N slice:
that slice is the only parameter the optimizer ever sees. Just before a unit's
forward the slices are all-gathered and the unit's modules get views into the full
vector; after the forward the full vector's memory is freed. When backward needs the
parameters again, autograd asks for what it saved and the unit gathers them once
more. The gradient of the full vector is reduce-scattered: each rank receives the
averaged gradient of its own slice. ``full_state_dict`` gathers everything for
export.

The script trains the book's GPT (its output head tied to the token embedding, and
the position embedding frozen, so requires_grad=False is exercised too) from the same
start on the same batches with MinimalFSDP, with DDP and with fully_shard, and
compares the weights after every step; a DDP model trained on another global batch
(the same batches in the opposite order) is the control. With bf16 (--compute-dtypes
fp32 bf16, the default, runs both) the gathered copies are bf16 while the slices stay
fp32, and fully_shard gets the matching MixedPrecisionPolicy.
"""

import argparse
import copy
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.compare import training_gap
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES, without_key_bias

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class GatherShards(torch.autograd.Function):
    """Forward: all-gather the slices into the full vector. Backward:
    reduce-scatter."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group: "FlatGroup") -> torch.Tensor:
        ctx.group = group
        dist.all_gather_single(group.full, shard.to(group.full.dtype))
        return group.full.view_as(group.full)

    @staticmethod
    def backward(ctx, full_grad: torch.Tensor):
        world_size = dist.get_world_size()
        # Reduce in at least fp32 even when the gathered copies are bf16 (a sum
        # of N bf16 gradients loses bits); fp32 and fp64 slices in their own.
        shard = ctx.group.shard
        reduce_dtype = shard.dtype if shard.dtype.itemsize >= 4 else torch.float32
        shard_grad = shard.new_empty(full_grad.numel() // world_size,
                                     dtype=reduce_dtype)
        dist.reduce_scatter_single(shard_grad, full_grad.to(reduce_dtype),
                                   op=dist.ReduceOp.SUM)
        # the gradient is complete: backward is done with the parameters
        ctx.group.free()
        return shard_grad.div_(world_size).to(shard.dtype), None


class FlatGroup:
    """Parameters of one unit, flattened into one vector; this rank keeps a 1/N
    slice."""

    def __init__(self, uses: dict[nn.Parameter, list[tuple[nn.Module, str]]],
                 dtype: torch.dtype | None):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        # where each parameter appears: twice if tied
        self.uses = list(uses.values())
        self.shapes = [p.shape for p in uses]
        self.numels = [p.numel() for p in uses]
        flat = torch.cat([p.detach().reshape(-1) for p in uses])
        padded = -(-flat.numel() // world_size) * world_size  # a multiple of N
        flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
        trainable = next(iter(uses)).requires_grad
        shard = flat.chunk(world_size)[rank].clone()
        self.shard = nn.Parameter(shard, requires_grad=trainable)
        # The gathered copy: in the compute dtype, else in the parameters' own
        self.full = flat.new_empty(padded, dtype=dtype or flat.dtype)
        self.free()

    def gathered_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()

    def gather(self, for_autograd: bool) -> torch.Tensor:
        """Allocate the full vector and all-gather the slices into it."""
        self.full.untyped_storage().resize_(self.full.numel()
                                            * self.full.element_size())
        if for_autograd and self.shard.requires_grad:
            return GatherShards.apply(self.shard, self)
        with torch.no_grad():
            dist.all_gather_single(self.full, self.shard.to(self.full.dtype))
        return self.full

    def free(self) -> None:
        """Free the full vector's memory; its views stay valid for the next
        gather."""
        self.full.untyped_storage().resize_(0)

    def unflatten(self, full: torch.Tensor) -> list[torch.Tensor]:
        pieces = full.split([*self.numels, full.numel() - sum(self.numels)])
        return [p.view(shape) for p, shape in zip(pieces, self.shapes, strict=False)]

    def install(self, full: torch.Tensor) -> None:
        """Point every use of every parameter at its piece of the gathered vector."""
        for tensor, uses in zip(self.unflatten(full), self.uses, strict=True):
            for module, name in uses:
                setattr(module, name, tensor)


class MinimalFSDP(nn.Module):
    """Fully sharded data parallelism: shard, gather on demand, reduce-scatter."""

    def __init__(self, module: nn.Module, units: list[nn.Module],
                 compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.module = module
        with torch.no_grad():  # every rank starts from rank 0's weights, as with DDP
            for tensor in module.parameters():
                dist.broadcast(tensor, src=0)
        self.groups: dict[nn.Module, list[FlatGroup]] = {}
        taken: set[nn.Parameter] = set()
        for unit in [*units, module]:  # the root gets what the units did not take
            uses: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
            for owner in unit.modules():
                for name, param in list(owner._parameters.items()):
                    if param is not None and param not in taken:
                        uses.setdefault(param, []).append((owner, name))
                        # A plain attribute from now on, set anew before every
                        # forward.
                        del owner._parameters[name]
            taken |= set(uses)
            # One vector, one requires_grad: frozen and trainable parameters kept
            # apart.
            by_grad = itertools.groupby(
                sorted(uses.items(), key=lambda kv: kv[0].requires_grad),
                key=lambda kv: kv[0].requires_grad)
            self.groups[unit] = [FlatGroup(dict(group), compute_dtype)
                                 for _, group in by_grad]
            unit.register_forward_pre_hook(self._before_forward)
            unit.register_forward_hook(self._after_forward)
        self.shards = nn.ParameterList(g.shard for g in self.all_groups())
        self.in_backward = False
        self.peak_gathered_bytes = 0

    def all_groups(self) -> list[FlatGroup]:
        return [group for groups in self.groups.values() for group in groups]

    def forward(self, *args, **kwargs):
        # Autograd saves views of the gathered vectors for backward. We store a
        # recipe instead (which vector, which view) and gather the vector again when
        # asked.
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    def _before_forward(self, unit: nn.Module, _inputs) -> None:
        for group in self.groups[unit]:
            group.install(group.gather(for_autograd=torch.is_grad_enabled()))
        self._note_memory()

    def _after_forward(self, unit: nn.Module, _inputs, _output) -> None:
        # the root's parameters are needed first in backward
        if unit is not self.module:
            for group in self.groups[unit]:
                group.free()

    def _pack(self, tensor: torch.Tensor):
        for group in self.all_groups():
            if tensor._base is group.full:
                return group, tensor.size(), tensor.stride(), tensor.storage_offset()
        return tensor

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        group, size, stride, offset = packed
        if not self.in_backward:  # the first request of this backward pass
            self.in_backward = True
            Variable._execution_engine.queue_callback(self._after_backward)
        if group.gathered_bytes() == 0:
            group.gather(for_autograd=False)
            self._note_memory()
        return group.full.as_strided(size, stride, offset)

    def _after_backward(self) -> None:
        # frozen groups have no backward to free them
        for group in self.all_groups():
            group.free()
        self.in_backward = False

    def _note_memory(self) -> None:
        gathered = sum(g.gathered_bytes() for g in self.all_groups())
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, gathered)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Gather every group in the slices' dtype; return the weights
        under their original names."""
        names = {module: name for name, module in self.module.named_modules()}
        state = {}
        for group in self.all_groups():
            full = group.shard.new_empty(group.full.numel())
            dist.all_gather_single(full, group.shard.detach())
            for tensor, uses in zip(group.unflatten(full), group.uses, strict=True):
                for module, name in uses:
                    state[f"{names[module]}.{name}".lstrip(".")] = tensor.clone()
        return state


def weight_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over all weights but the attention key biases (see
    ``without_key_bias``).

    The same on every rank: both are full state dicts.
    """
    a, b = without_key_bias(a), without_key_bias(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small",
                        help="model size (default: small)")
    parser.add_argument("--steps", type=positive_int, default=5,
                        help="optimizer steps to compare (default: 5)")
    parser.add_argument("--batch-size", type=positive_int, default=8,
                        help="windows per process per step")
    parser.add_argument("--compute-dtypes", nargs="+", choices=sorted(DTYPES),
                        default=["fp32", "bf16"],
                        help="dtypes of the gathered parameters to compare, one run "
                             "each (the shards stay fp32)")
    parser.add_argument("--lr", type=float, default=DEFAULTS.lr)
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    add_backend_and_metrics(parser)
    return parser.parse_args()


def compare(dtype: torch.dtype, start: GPT, batches, args, metrics, device) -> None:
    """Train MinimalFSDP, DDP, fully_shard and the control from ``start``; record
    the gaps per step."""
    name = str(dtype).removeprefix("torch.")
    ddp = DDP(copy.deepcopy(start), device_ids=ddp_device_ids(device))
    control = DDP(copy.deepcopy(start), device_ids=ddp_device_ids(device))
    sharded = copy.deepcopy(start)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in sharded.blocks:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(sharded, mp_policy=mp_policy)
    minimal_model = copy.deepcopy(start)
    minimal = MinimalFSDP(minimal_model, list(minimal_model.blocks), dtype)

    runs = {"minimal": minimal, "ddp": ddp, "fully_shard": sharded,
            "control": control}
    optimizers = {key: torch.optim.AdamW([p for p in m.parameters()
                                          if p.requires_grad], lr=args.lr)
                  for key, m in runs.items()}
    for step in range(1, args.steps + 1):
        losses = {}
        for key, model in runs.items():
            # The control trains on the same batches in the opposite order: another
            # global batch.
            x, y = batches[-step] if key == "control" else batches[step - 1]
            loss = model(x, y)
            loss.backward()
            optimizers[key].step()
            optimizers[key].zero_grad(set_to_none=True)
            losses[key] = loss.item()
        weights = {"minimal": minimal.full_state_dict(),
                   "ddp": ddp.module.state_dict(),
                   "control": control.module.state_dict(),
                   "fully_shard": {k: v.full_tensor()
                                   for k, v in sharded.state_dict().items()}}
        record = {"dtype": name, "step": step, "losses": losses,
                  "gap_minimal_ddp": weight_gap(weights["minimal"], weights["ddp"]),
                  "gap_minimal_fully_shard": weight_gap(weights["minimal"],
                                                        weights["fully_shard"]),
                  "gap_fully_shard_ddp": weight_gap(weights["fully_shard"],
                                                    weights["ddp"]),
                  "gap_control_ddp": weight_gap(weights["control"], weights["ddp"]),
                  # The relative L2 gap of dtbook.compare: after one Adam step every
                  # entry has moved by about lr, so the largest difference of any two
                  # runs is about 2 lr; the L2 gap counts how many entries moved
                  # differently, which tells them apart.
                  "relative": {pair: training_gap(weights[a], weights[b])
                               for pair, (a, b) in
                               {"minimal_ddp": ("minimal", "ddp"),
                                "minimal_fully_shard": ("minimal", "fully_shard"),
                                "fully_shard_ddp": ("fully_shard", "ddp"),
                                "control_ddp": ("control", "ddp")}.items()},
                  "frozen_unchanged": torch.equal(weights["minimal"]["pos_emb.weight"], start.pos_emb.weight),
                  "tied_equal": torch.equal(weights["minimal"]["head.weight"],
                                            weights["minimal"]["tok_emb.weight"]),
                  "max_abs_weight": max(t.abs().max().item()
                                        for t in weights["ddp"].values()),
                  "peak_gathered_bytes": minimal.peak_gathered_bytes,
                  "gathered_bytes_after_step": sum(g.gathered_bytes()
                                                   for g in minimal.all_groups())}
        metrics.write(event="step", **record)
        if dist.get_rank() == 0:
            gap = record["relative"]
            print(f"{name} step {step}: relative L2 gap minimal-DDP "
                  f"{gap['minimal_ddp']:.2e}, minimal-fully_shard "
                  f"{gap['minimal_fully_shard']:.2e}, control (other batch)-DDP "
                  f"{gap['control_ddp']:.2e}")
    groups = minimal.all_groups()
    metrics.write(event="memory", dtype=name,
                  full_gathered_bytes=sum(g.full.numel() * g.full.element_size()
                                          for g in groups),
                  peak_gathered_bytes=minimal.peak_gathered_bytes,
                  shard_bytes=sum(g.shard.numel() * g.shard.element_size()
                                  for g in groups),
                  shard_numels=[g.shard.numel() for g in groups],
                  full_numels=[g.full.numel() for g in groups],
                  trainable=[g.shard.requires_grad for g in groups])


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    dataset = corpus_windows(args.steps * world_size * args.batch_size * cfg.context
                             + 1, cfg.vocab_size,
                             cfg.context, args.seed)
    batches = first_batches(dataset, args.batch_size, rank, world_size, args.seed,
                            args.steps, device)
    torch.manual_seed(args.seed)
    start = GPT(cfg).to(device)
    # a frozen parameter; the head is tied to tok_emb
    start.pos_emb.weight.requires_grad_(False)
    metrics.write(event="model", params=sum(p.numel() for p in start.parameters()),
                  trainable=sum(p.numel() for p in start.parameters()
                                if p.requires_grad))
    for name in args.compute_dtypes:
        compare(DTYPES[name], start, batches, args, metrics, device)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
