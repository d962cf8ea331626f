"""FSDP2's less common knobs, each measured on the tiny GPT in one step or a few.

    torchrun --standalone --nproc_per_node=4 scripts/ch4_knobs.py
    torchrun --standalone --nproc_per_node=4 scripts/ch4_knobs.py --knobs offload_cost

reshard_to_group      reshard_after_forward=True, False and an int (a smaller group):
                      what stays gathered between forward and backward, and where
                      backward's all-gathers go
reshard_after_backward set_reshard_after_backward(False) with set_requires_gradient_sync
                      (False) on the micro-steps of gradient accumulation
mixed_precision       MixedPrecisionPolicy's output_dtype and cast_forward_inputs, and
                      autocast with and without a policy: the dtype of the all-gathers
shard_placement       fully_shard(..., shard_placement_fn=...) sharding weights on dim 1
offload_cost          the step time with and without CPUOffloadPolicy

Needs a world size with a divisor other than 1 and itself (4) for the int reshard.
"""

import argparse
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.collectives import CollectiveLog
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group
from dtbook.metrics import run_each
from dtbook.model import GPT, MODEL_SIZES
from dtbook.timing import spread

KNOBS = ["reshard_to_group", "reshard_after_backward", "mixed_precision",
         "shard_placement", "offload_cost"]
CFG = MODEL_SIZES["tiny"]


def new_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def shard(model: GPT, **kwargs) -> GPT:
    """The chapter's layout: every block a unit, the root holds the rest."""
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})
    return model


def gathers(log: CollectiveLog) -> list[dict]:
    return [e for e in log.collectives() if e["op"] == "all_gather"]


def held_elements(unit: FSDPModule) -> int:
    """Elements of a unit's parameters this rank holds in memory: its resting shard
    (_sharded_param_data), the extra shard an int reshard_after_forward clones after
    forward (_sharded_post_forward_param_data) and the gathered parameter
    (all_gather_outputs, storage resized to 0 when freed), each storage once. The
    post-forward shard exists only once an int has made one."""
    storages = {}
    for fsdp_param in unit._get_fsdp_state()._fsdp_param_group.fsdp_params:
        for tensor in (fsdp_param._sharded_param_data,
                       getattr(fsdp_param, "_sharded_post_forward_param_data", None),
                       *fsdp_param.all_gather_outputs):
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr(), storage.nbytes()] = (
                    storage.nbytes() // tensor.element_size())
    return sum(storages.values())


def reshard_to_group(tokens, targets) -> dict:
    """Per setting: elements of block 0's weights this rank holds between forward and
    backward (all its storages, and the local part of the parameter registered on the
    module), and the group sizes of backward's all-gathers."""
    outcome, grads = {}, {}
    for name, value in (("True", True), ("False", False), ("2", 2)):
        model = shard(new_model(), reshard_after_forward=value)
        loss = model(tokens, targets)
        held = held_elements(model.blocks[0])
        registered = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                         for p in model.blocks[0].parameters())
        with CollectiveLog() as log:
            loss.backward()
        sizes = sorted({len(e["group"]) for e in gathers(log)})
        grads[name] = torch.cat([p.grad.full_tensor().flatten()
                                 for p in model.parameters()])
        outcome[name] = {"held_between": held, "registered_between": registered,
                         "backward_gathers": len(gathers(log)),
                         "backward_gather_group_sizes": sizes}
    outcome["block_elements"] = sum(p.numel() for p in new_model().blocks[0].parameters())
    outcome["grads_equal"] = all(torch.equal(grads["True"], g) for g in grads.values())
    return outcome


def reshard_after_backward(tokens, targets) -> dict:
    """All-gathers over an accumulation of two micro-steps, the gradients after it, and
    the loss of a forward after the optimizer step."""
    def accumulate(keep_gathered: bool, keep_on_last: bool = False):
        model = shard(new_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        halves = zip(tokens.chunk(2), targets.chunk(2), strict=True)
        with CollectiveLog() as log:
            for micro, (x, y) in enumerate(halves):
                last = micro == 1
                model.set_requires_gradient_sync(last)
                # keep the gathered parameters for the next micro-step's forward; on
                # the last micro-step, reshard (unless keep_on_last, the mistake)
                model.set_reshard_after_backward(not keep_on_last if last
                                                 else not keep_gathered)
                (model(x, y) / 2).backward()
        # the sharded parameters, as the optimizer holds them: while a unit stays
        # gathered, model.parameters() returns its gathered ones, without .grad
        sharded = optimizer.param_groups[0]["params"]
        grad = torch.cat([p.grad.full_tensor().flatten() for p in sharded])
        optimizer.step()  # steps the sharded parameters
        optimizer.zero_grad()
        with torch.no_grad():
            after = model(tokens, targets).item()
        return len(gathers(log)), grad, after, model

    default_count, default_grad, default_after, _ = accumulate(False)
    kept_count, kept_grad, kept_after, _ = accumulate(True)
    # The mistake: still False on the last micro-step. The units stay gathered through
    # optimizer.step(), and the next forward's unshard() returns early
    # (FSDPParamGroup.unshard: "if self.is_unsharded: return"), computing with the
    # gathered pre-step parameters. Resharding every unit makes it gather the stepped ones.
    _, forgot_grad, forgot_after, model = accumulate(True, keep_on_last=True)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    with torch.no_grad():
        resharded_after = model(tokens, targets).item()
    return {"default_gathers": default_count, "kept_gathers": kept_count,
            "grads_equal": torch.equal(default_grad, kept_grad), "n_layer": CFG.n_layer,
            "loss_after_step": {"default": default_after, "kept": kept_after,
                                "kept on the last micro-step": forgot_after,
                                "kept on the last, then reshard()": resharded_after},
            "forgot_grads_equal": torch.equal(default_grad, forgot_grad)}


def mixed_precision(tokens, targets) -> dict:
    bf16 = torch.bfloat16
    outcome = {}
    compute = MixedPrecisionPolicy(param_dtype=bf16)
    to_float32 = MixedPrecisionPolicy(param_dtype=bf16, output_dtype=torch.float32)
    for name, block_policy, root_policy in (
            ("param_dtype=bf16", compute, compute),
            ("root: + output_dtype=float32", compute, to_float32),
            # on the blocks, the last block's float32 output reaches the root's bf16
            # final norm: the root casts its own inputs (the tokens), not that one
            ("blocks too: + output_dtype=float32", to_float32, to_float32)):
        model = new_model()
        for block in model.blocks:
            fully_shard(block, mp_policy=block_policy)
        fully_shard(model, mp_policy=root_policy)
        try:
            outcome[name] = str(model(tokens).dtype)
        except RuntimeError as err:
            outcome[name] = "error: " + str(err).splitlines()[0][:70]
    # A block fed float32 activations, as the root hands them over without a policy.
    x = torch.randn(tokens.shape[0], CFG.context, CFG.n_embd)
    for cast in (True, False):
        block = new_model().blocks[0]
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=bf16,
                                                          cast_forward_inputs=cast))
        try:
            result = str(block(x).dtype)
        except RuntimeError as err:
            result = "error: " + str(err).splitlines()[0][:70]
        outcome[f"cast_forward_inputs={cast}"] = result
    # autocast casts per op; the policy decides what FSDP gathers.
    for name, policy in (("autocast only", MixedPrecisionPolicy()),
                         ("autocast + param_dtype=bf16", MixedPrecisionPolicy(param_dtype=bf16))):
        model = shard(new_model(), mp_policy=policy)
        with CollectiveLog() as log, torch.autocast(tokens.device.type, dtype=bf16):
            logits = model(tokens)
        outcome[name] = {"gather_dtypes": sorted({e["dtype"] for e in gathers(log)}),
                         "gather_bytes": sum(e["bytes"] for e in gathers(log)),
                         "logits": str(logits.dtype)}
    return outcome


def shard_placement(tokens, targets) -> dict:
    def dim1_for_matrices(param):
        return Shard(1) if param.ndim == 2 else None  # None: the default, Shard(0)

    outcome = {}
    losses, grads = {}, {}
    for name, fn in (("default", None), ("Shard(1) for matrices", dim1_for_matrices)):
        model = shard(new_model(), shard_placement_fn=fn)
        weight = model.blocks[0].qkv.weight
        outcome[name] = {"placements": str(weight.placements),
                         "local_shape": list(weight.to_local().shape),
                         "global_shape": list(weight.shape)}
        loss = model(tokens, targets)
        loss.backward()
        losses[name] = loss.item()
        grads[name] = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
    # the control: the default placement on another batch (every window shifted by one)
    model = shard(new_model())
    model(torch.roll(tokens, 1, dims=1), torch.roll(targets, 1, dims=1)).backward()
    control = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
    first, second = grads.values()
    outcome["loss_equal"] = len(set(losses.values())) == 1
    outcome["grad_relative_gap"] = ((first - second).norm() / first.norm()).item()
    outcome["control_relative_gap"] = ((first - control).norm() / first.norm()).item()
    return outcome


def offload_cost(tokens, targets, steps: int) -> dict:
    """Step times of two models, one with its state offloaded, stepped in turn (so
    that a change in the machine's load hits both)."""
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    runs = {}
    for name, kwargs in (("on the device", {}),
                         ("CPUOffloadPolicy", {"offload_policy": offload})):
        model = shard(new_model(), **kwargs)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), [])
    for _ in range(steps + 2):  # two warm-up steps each
        for model, optimizer, times in runs.values():
            dist.barrier()
            start = time.perf_counter()
            model(tokens, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
    outcome = {"steps": steps}
    for name, (_, _, times) in runs.items():
        times = [1e3 * t for t in times[2:]]
        quartiles = spread(times)  # the book's one spread
        outcome[name] = {"median_ms": quartiles["median"], "q1_ms": quartiles["p25"],
                         "q3_ms": quartiles["p75"],
                         "min_ms": min(times), "max_ms": max(times)}
    return outcome


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--knobs", nargs="+", choices=KNOBS, default=KNOBS, metavar="NAME",
                        help=f"which to measure (default: all): {', '.join(KNOBS)}")
    parser.add_argument("--steps", type=positive_int, default=12,
                        help="timed steps per offload setting (default: 12)")
    add_backend_and_metrics(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    world = dist.get_world_size()
    if "reshard_to_group" in args.knobs and (world < 4 or world % 2):
        raise ScriptError(f"reshard_to_group needs an even world size of at least 4, not "
                          f"{world}: run with --nproc_per_node=4, or leave it out with --knobs")
    metrics = open_metrics(args.metrics, backend, device)
    torch.manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.context), device=device)
    targets = torch.roll(tokens, -1, dims=1)
    torch.set_default_device(device)
    demos = {"reshard_to_group": partial(reshard_to_group, tokens, targets),
             "reshard_after_backward": partial(reshard_after_backward, tokens, targets),
             "mixed_precision": partial(mixed_precision, tokens, targets),
             "shard_placement": partial(shard_placement, tokens, targets),
             "offload_cost": partial(offload_cost, tokens, targets, args.steps)}
    run_each(demos, args.knobs, metrics, "knob", dist.get_rank())
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
