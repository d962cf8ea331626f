"""Seven ways to get FSDP wrong, each shown failing (or silently wrong) and then fixed.

    torchrun --standalone --nproc_per_node=2 scripts/ch4_pitfalls.py
    torchrun --standalone --nproc_per_node=2 scripts/ch4_pitfalls.py --pitfalls tied_weights

submodule_call         calling a submodule that is not an FSDP unit, outside the
root's forward optimizer_too_early    building the optimizer before fully_shard
replaced the parameters edit_gathered_copy     changing the gathered parameters,
which FSDP throws away at reshard mixed_apis             wrapping FSDP2 units in an
FSDP1 wrapper tied_weights           putting two modules that share a weight into
different FSDP units nonpersistent_buffer   a buffer registered with persistent=False,
materialized by to_empty and never in a checkpoint state_dict_one_rank    gathering a
full state dict inside `if rank == 0:` (a deadlock)

Every collective here gives up after --timeout-s seconds instead of waiting for ever,
so the deadlock ends with an error on rank 0. It runs last: a collective that timed
out leaves its process group unusable, so the other ranks wait for rank 0's word on a
TCPStore instead.
"""

import argparse
import datetime
import os
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dtbook.cli import add_backend_and_metrics, one_line, positive_int, run_main, script_parser
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group
from dtbook.metrics import run_each
from dtbook.model import GPT, MODEL_SIZES
from dtbook.ports import free_port

PITFALLS = ["submodule_call", "optimizer_too_early", "edit_gathered_copy",
            "mixed_apis", "tied_weights", "nonpersistent_buffer",
            "state_dict_one_rank"]


def new_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(MODEL_SIZES["tiny"])


def shard(model: GPT) -> GPT:
    """The chapter's layout: every block a unit, the root holds the rest."""
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def attempt(action) -> str | None:
    """Run ``action``; return its error as one line, or None if it worked."""
    try:
        action()
    except Exception as err:  # each pitfall fails with its own exception type
        return one_line(err)
    return None


def full_weights(model) -> dict[str, torch.Tensor]:
    return {name: value.full_tensor().clone()
            for name, value in model.state_dict().items()}


def submodule_call(tokens, targets) -> dict:
    model = shard(new_model())
    # tok_emb is no FSDP unit: its weight belongs to the root and its forward's hook.
    broken = attempt(lambda: model.tok_emb(tokens))
    model.unshard()  # what the root's forward does first: gather its parameters
    embedded = model.tok_emb(tokens)
    model.reshard()
    reference = new_model().tok_emb(tokens)
    # A block is a unit of its own: calling it directly gathers its parameters.
    block_call = attempt(lambda: model.blocks[0](embedded))
    return {"broken_error": broken,
            "fixed_matches_unsharded": torch.equal(embedded, reference),
            "block_call_error": block_call}


def optimizer_too_early(tokens, targets) -> dict:
    def changed_after_one_step(optimizer_first: bool) -> int:
        model = new_model()
        early = torch.optim.AdamW(model.parameters()) if optimizer_first else None
        shard(model)  # replaces every parameter by a new, sharded one
        optimizer = early or torch.optim.AdamW(model.parameters())
        before = full_weights(model)
        model(tokens, targets).backward()
        optimizer.step()
        after = full_weights(model)
        return sum(not torch.equal(before[name], after[name]) for name in before)

    return {"tensors": len(new_model().state_dict()),
            "broken_changed": changed_after_one_step(True),
            "fixed_changed": changed_after_one_step(False)}


def edit_gathered_copy(tokens, targets) -> dict:
    model = shard(new_model())
    start = model.tok_emb.weight.full_tensor().clone()
    model.unshard()
    with torch.no_grad():
        # the gathered copy: reshard frees it, edit too
        model.tok_emb.weight.mul_(0.5)
    model.reshard()
    after_broken = model.tok_emb.weight.full_tensor().clone()
    with torch.no_grad():
        # the sharded DTensor: every rank halves its shard
        model.tok_emb.weight.mul_(0.5)
    after_fixed = model.tok_emb.weight.full_tensor()
    return {"broken_unchanged": torch.equal(after_broken, start),
            "fixed_halved": torch.equal(after_fixed, start * 0.5)}


def mixed_apis(tokens, targets) -> dict:
    def fsdp1_around_fsdp2():
        model = new_model()
        for block in model.blocks:
            fully_shard(block)
        FSDP(model, device_id=torch.device("cpu"))(tokens, targets).backward()

    fixed = shard(new_model())
    loss = fixed(tokens, targets)
    loss.backward()
    return {"broken_error": attempt(fsdp1_around_fsdp2), "fixed_loss": loss.item()}


def tied_weights(tokens, targets) -> dict:
    def head_in_its_own_unit():
        model = new_model()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model.head)  # its weight is tok_emb's, which the root will own
        fully_shard(model)
        model(tokens, targets)  # the conflict is found when the units first run

    model = new_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard([model.tok_emb, model.head])  # both users of the weight in one unit
    fully_shard(model)
    loss = model(tokens, targets)
    loss.backward()
    return {"broken_error": attempt(head_in_its_own_unit), "fixed_loss": loss.item(),
            "fixed_still_tied": model.head.weight is model.tok_emb.weight}


class ScaledGPT(nn.Module):
    """The GPT with a derived table in a non-persistent buffer (as RoPE keeps its
    frequencies): computed in __init__, never saved."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt
        self.register_buffer("scale", torch.empty(gpt.cfg.vocab_size), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.scale.copy_(torch.linspace(0.5, 1.5, self.scale.numel()))

    def forward(self, tokens):
        return self.gpt(tokens) * self.scale


def nonpersistent_buffer(tokens, targets) -> dict:
    reference = ScaledGPT(new_model())
    shard(reference.gpt)
    fully_shard(reference)
    options = StateDictOptions(full_state_dict=True)
    # what a checkpoint holds
    saved = get_model_state_dict(reference, options=options)

    def restored(reset: bool) -> ScaledGPT:
        with torch.device("meta"):
            model = ScaledGPT(GPT(MODEL_SIZES["tiny"]))
        shard(model.gpt)
        fully_shard(model)
        # parameters *and* buffers: uninitialized memory (torch.empty_like). In
        # deterministic mode torch fills it with NaN (fill_uninitialized_memory), so
        # the broken case shows the same thing on every run instead of garbage.
        deterministic = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            model.to_empty(device=tokens.device)
        finally:
            torch.use_deterministic_algorithms(deterministic)
        # restores the parameters only
        set_model_state_dict(model, saved, options=options)
        if reset:
            model.reset_buffers()  # the fix: recompute what no checkpoint holds
        return model

    with torch.no_grad():
        expected = reference(tokens)
        broken, fixed = restored(reset=False), restored(reset=True)
        broken_output = broken(tokens)
        return {"in_state_dict": "scale" in saved, "saved_keys": len(saved),
                "broken_buffer_equal": torch.equal(broken.scale, reference.scale),
                "broken_buffer_nan": bool(broken.scale.isnan().all()),
                "broken_output_equal": torch.equal(broken_output, expected),
                "broken_output_nan": bool(broken_output.isnan().all()),
                "fixed_output_equal": torch.equal(fixed(tokens), expected),
                # fully_shard shards parameters (DTensors), never buffers: each rank
                # keeps a whole copy of its own
                "buffer_sharded": isinstance(broken.scale, DTensor),
                "parameters_sharded": all(isinstance(p, DTensor)
                                          for p in broken.parameters())}


def state_dict_one_rank(tokens, targets, store: dist.TCPStore) -> dict:
    model = shard(new_model())
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # Fixed: every rank takes part in the gather; cpu_offload leaves the result on
    # rank 0.
    full = get_model_state_dict(model, options=options)
    fixed_keys = len(full)
    broken = None
    started = datetime.datetime.now()
    if dist.get_rank() == 0:
        # Broken: the other ranks never join the all-gathers inside; rank 0 waits.
        broken = attempt(lambda: get_model_state_dict(model, options=options))
        store.set("state_dict_one_rank", "done")
    else:
        store.wait(["state_dict_one_rank"])
    seconds = (datetime.datetime.now() - started).total_seconds()
    return {"broken_error": broken, "broken_seconds": seconds,
            "fixed_keys_on_rank0": fixed_keys}


def side_channel(timeout_s: float) -> dist.TCPStore:
    """A key-value store that is no collective: it still works after a collective
    timed out."""
    port = [free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    return dist.TCPStore(os.environ["MASTER_ADDR"], port[0], dist.get_world_size(),
                         dist.get_rank() == 0,
                         timeout=datetime.timedelta(seconds=10 * timeout_s))


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--pitfalls", nargs="+", choices=PITFALLS, default=PITFALLS,
                        metavar="NAME",
                        help=f"which to show (default: all): {', '.join(PITFALLS)}")
    parser.add_argument("--timeout-s", type=positive_int, default=10,
                        help="how long any collective may wait for the other ranks "
                             "(default: 10)")
    add_backend_and_metrics(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend, timeout_s=args.timeout_s)
    metrics = open_metrics(args.metrics, backend, device)
    store = side_channel(args.timeout_s)
    torch.manual_seed(1)
    tokens = torch.randint(0, MODEL_SIZES["tiny"].vocab_size,
                           (2, MODEL_SIZES["tiny"].context), device=device)
    targets = torch.roll(tokens, -1, dims=1)
    torch.set_default_device(device)
    demos = {"submodule_call": partial(submodule_call, tokens, targets),
             "optimizer_too_early": partial(optimizer_too_early, tokens, targets),
             "edit_gathered_copy": partial(edit_gathered_copy, tokens, targets),
             "mixed_apis": partial(mixed_apis, tokens, targets),
             "tied_weights": partial(tied_weights, tokens, targets),
             "nonpersistent_buffer": partial(nonpersistent_buffer, tokens, targets),
             "state_dict_one_rank": partial(state_dict_one_rank, tokens, targets, store)}
    run_each(demos, args.pitfalls, metrics, "pitfall", dist.get_rank())
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
