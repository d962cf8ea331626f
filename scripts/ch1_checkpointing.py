"""Activation checkpointing: trade recomputation for memory, and prove the gradients unchanged.

    python scripts/ch1_checkpointing.py
    python scripts/ch1_checkpointing.py --model large --batch-size 8 --repeats 10
    torchrun --standalone --nproc_per_node=1 scripts/ch1_checkpointing.py

The book's GPT is trained one step with each strategy, from the same weights, batch and RNG state:

  none          autograd keeps every activation until backward
  every block   torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) around each block
  every other   the same around blocks 0, 2, 4, ...
  sequential    checkpoint_sequential(blocks, --segments, x): its last segment is not checkpointed
  selective     every block, but matmul and attention outputs are saved and only the cheap ops
                (layer norm, GELU, dropout, views) recomputed: create_selective_checkpoint_contexts

For each: the activations still held when the forward pass ends and the peak of the whole step
(MemTracker, which sees tensors outside autograd's nodes, like the selective cache, too), the
peak again from a second, independent tracker (dtbook.measure.LiveStoragePeak), the FLOPs of
forward plus backward with the recomputation (FlopCounterMode, in a pass of its own: its module
tracker keeps recomputed activations alive, which a last pass under both shows; under the MATH
SDPA backend, because the CPU's default attention kernel is not in its FLOP registry and would
count 0, which a second FLOP pass under the default backend records), the median step
time, and the largest gradient difference from the un-checkpointed model. Dropout is on (--dropout), so
the recomputed forward must replay the same random masks: checkpoint restores the RNG state for
that, and the control run with preserve_rng_state=False shows what happens when it does not.
Last, forward passes in eval and training mode, with and without torch.no_grad(), count the
RNG-state stashes checkpoint makes: the torch.is_grad_enabled() guard in Checkpointed skips
checkpoint where no backward can follow, and keeps it for a model trained in eval mode.
"""

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import drain_gloo_workers, open_metrics, start_single_device
from dtbook.measure import LiveStoragePeak, median_ms
from dtbook.model import GPT, MODEL_SIZES

STRATEGIES = ["none", "every block", "every other", "sequential", "selective"]
aten = torch.ops.aten
# The expensive ops, whose outputs selective checkpointing keeps: matmuls and every SDPA kernel.
SAVED_BY_SELECTIVE = {
    aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_SIZES), default="medium", help="model size (default: medium)")
    add("--batch-size", type=positive_int, default=DEFAULTS.batch_size, help="windows per step (default: 16)")
    add("--dropout", type=float, default=0.1,
        help="dropout probability, on so that recomputation must replay the RNG (default: 0.1)")
    add("--segments", type=positive_int, default=2, help="checkpoint_sequential's segments (default: 2)")
    add("--repeats", type=positive_int, default=3, help="timed steps per strategy (default: 3)")
    add("--seed", type=int, default=DEFAULTS.seed, help="seeds the corpus, the weights and dropout")
    add_backend_and_metrics(parser)
    args = parser.parse_args(argv)
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    n_layer = MODEL_SIZES[args.model].n_layer
    if args.segments > n_layer:
        raise ScriptError(f"--segments {args.segments} is more than the {n_layer} blocks of the "
                          f"{args.model} model")
    return args


# --------------------------------------------------------------------------
# The strategies, as wrappers around the book's blocks
# --------------------------------------------------------------------------


def save_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in SAVED_BY_SELECTIVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    """A block under checkpoint: its input is kept, its activations recomputed."""

    def __init__(self, block: nn.Module, selective: bool = False,
                 preserve_rng_state: bool = True):
        super().__init__()
        self.block = block
        self.preserve_rng_state = preserve_rng_state
        self.context_fn = None
        if selective:
            self.context_fn = functools.partial(create_selective_checkpoint_contexts,
                                                save_matmuls_and_attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Without grad mode no backward can follow: nothing to save memory for.
        # Not self.training: a model trained in eval mode (no dropout) still
        # needs checkpoint.
        if not torch.is_grad_enabled():
            return self.block(x)
        extra = {"context_fn": self.context_fn} if self.context_fn else {}
        return checkpoint(self.block, x, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state, **extra)


class CheckpointedSequence(nn.Module):
    """All blocks as one module that checkpoint_sequential splits into ``segments``."""

    def __init__(self, blocks: nn.ModuleList, segments: int):
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.blocks, self.segments, x, use_reentrant=False)


def with_strategy(model: GPT, strategy: str, segments: int,
                  preserve_rng_state: bool = True) -> GPT:
    """A copy of ``model`` whose blocks run under ``strategy``; the same
    parameters."""
    model = copy.deepcopy(model)
    blocks = model.blocks
    if strategy == "every block":
        model.blocks = nn.ModuleList(
            Checkpointed(b, preserve_rng_state=preserve_rng_state) for b in blocks)
    elif strategy == "every other":
        model.blocks = nn.ModuleList(Checkpointed(b) if i % 2 == 0 else b
                                     for i, b in enumerate(blocks))
    elif strategy == "sequential":
        # GPT.forward iterates over model.blocks: one module that runs them all
        # fits in.
        model.blocks = nn.ModuleList([CheckpointedSequence(blocks, segments)])
    elif strategy == "selective":
        model.blocks = nn.ModuleList(Checkpointed(b, selective=True) for b in blocks)
    elif strategy != "none":
        raise ValueError(f"unknown strategy {strategy!r}")
    return model


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------


@contextlib.contextmanager
def no_cycle_collection():
    """Collect garbage first, then keep Python's cycle collector out of the measured step:
    when it happens to run (it depends on how many objects came before) it frees the
    reference cycles a mode's hooks leave, and a peak would change from run to run."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def one_step(model: GPT, x, y, seed: int, mode) -> list[torch.Tensor]:
    """Forward and backward under ``mode``, from a fixed RNG state; the gradients."""
    torch.manual_seed(seed)  # the same dropout masks for every strategy and pass
    with no_cycle_collection(), mode:
        model(x, y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def memory_pass(model: GPT, x, y, seed: int, device, flops=None) -> dict:
    """MemTracker's view of one step: activations after forward, and the peak.

    Memory and FLOPs are measured in separate passes: FlopCounterMode's module
    tracker hooks every module's inputs and outputs, the recomputed ones included,
    and keeps their graphs, so the recomputed activations live until the mode exits.
    ``flops`` runs the pass under a FlopCounterMode anyway, to show that artifact.
    """
    tracker = MemTracker()
    tracker.track_external(model)
    torch.manual_seed(seed)
    with no_cycle_collection(), tracker, (flops or contextlib.nullcontext()):
        loss = model(x, y)
        after_forward = tracker.get_tracker_snapshot()[device]
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[device]
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    category = {getattr(k, "name", k): v for k, v in after_forward.items()}
    peak = {getattr(k, "name", k): v for k, v in peak.items()}
    return {"activations_after_forward": category["ACT"], "peak_bytes": peak["Total"],
            "peak_parameter_bytes": peak["PARAM"], "grads": grads}


def measured_step(model: GPT, x, y, seed: int, device) -> dict:
    """Memory (MemTracker), memory again (LiveStoragePeak), FLOPs twice: four passes."""
    row = memory_pass(model, x, y, seed, device)
    live = LiveStoragePeak()
    one_step(model, x, y, seed, live)
    # FlopCounterMode's registry has no formula for the CPU's attention kernel
    # (_scaled_dot_product_flash_attention_for_cpu) and counts it as 0. Under the MATH
    # backend attention runs as bmm ops, which it counts.
    flops = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH):
        one_step(model, x, y, seed, flops)
    default_flops = FlopCounterMode(display=False)
    one_step(model, x, y, seed, default_flops)
    # Parameters enter LiveStoragePeak's count only through the views ops return of
    # them; MemTracker counts every parameter (its PARAM).
    live_parameters = live.bytes_at_peak(model.parameters())
    live_names = live.tensors_at_peak(dict(model.named_parameters(remove_duplicate=True)))
    return row | {"live_peak_bytes": live.peak_bytes, "live_peak_parameter_bytes": live_parameters,
                  "live_peak_parameters": sorted(live_names),
                  "flops": flops.get_total_flops(),
                  "flops_default_backend": default_flops.get_total_flops()}


def rng_stashes(model: GPT, x, training: bool, grad: bool) -> tuple[int, torch.Tensor]:
    """How often a forward pass saved the RNG state, and its logits.

    checkpoint stashes the RNG state on every call, grad or no grad, for a recomputation
    that only a backward pass would run. The ``torch.is_grad_enabled()`` guard in
    Checkpointed skips it, and checkpoint altogether, under torch.no_grad().
    """
    calls = 0
    get_rng_state = torch.get_rng_state

    def counted():
        nonlocal calls
        calls += 1
        return get_rng_state()

    model.train(training)
    torch.get_rng_state = counted  # checkpoint calls it through the torch module
    try:
        with torch.set_grad_enabled(grad):
            logits = model(x).detach()
    finally:
        torch.get_rng_state = get_rng_state
        model.train()
    return calls, logits


def gradient_difference(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> dict:
    """Largest entry-wise difference, and the largest reference entry it is to be judged against."""
    return {"max_abs_difference": max((g - r).abs().max().item() for g, r in zip(grads, reference, strict=True)),
            "max_abs_gradient": max(r.abs().max().item() for r in reference),
            "bitwise_equal": all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))}


def step_time_ms(model: GPT, x, y, repeats: int, device) -> float:
    def step():
        model(x, y).backward()
        model.zero_grad(set_to_none=True)

    return median_ms(step, repeats, device)


def main() -> None:
    args = parse_args()
    backend, device = start_single_device(args.backend)
    metrics = open_metrics(args.metrics, backend, device)
    cfg = dataclasses.replace(MODEL_SIZES[args.model], dropout=args.dropout)
    dataset = corpus_windows(DEFAULTS.corpus_tokens, cfg.vocab_size, cfg.context, args.seed)
    [(x, y)] = first_batches(dataset, args.batch_size, 0, 1, args.seed, 1, device)
    torch.manual_seed(args.seed)
    base = GPT(cfg).to(device)
    print(f"{args.model} model ({cfg.n_layer} blocks), batch {args.batch_size} x {cfg.context}, "
          f"dropout {args.dropout}, on {device}")

    print(f"{'strategy':<13} {'kept after fwd':>15} {'peak':>12} {'GFLOP':>7} {'step ms':>8} {'max |dgrad|':>12}")
    reference = None
    for strategy in STRATEGIES:
        model = with_strategy(base, strategy, args.segments)
        row = measured_step(model, x, y, args.seed, device)
        grads = row.pop("grads")
        reference = reference or grads
        row.update(gradient_difference(grads, reference))
        row["step_ms"] = step_time_ms(model, x, y, args.repeats, device)
        metrics.write(event="strategy", strategy=strategy, **row)
        print(f"{strategy:<13} {row['activations_after_forward'] / 2**20:>11.2f} MiB "
              f"{row['peak_bytes'] / 2**20:>8.2f} MiB {row['flops'] / 1e9:>7.3f} {row['step_ms']:>8.1f} "
              f"{row['max_abs_difference']:>12.2e}")

    # The control: recompute without restoring the RNG, so dropout draws different masks.
    control = with_strategy(base, "every block", args.segments, preserve_rng_state=False)
    row = measured_step(control, x, y, args.seed, device)
    difference = gradient_difference(row.pop("grads"), reference)
    metrics.write(event="control", strategy="every block, preserve_rng_state=False", **difference)
    print(f"control, preserve_rng_state=False: max |dgrad| {difference['max_abs_difference']:.2e} "
          f"(largest gradient entry {difference['max_abs_gradient']:.2e})")

    # Without grad mode the guard skips checkpoint and its RNG stash; with it, checkpoint runs
    # in eval mode too (a model fine-tuned in eval mode keeps its memory saving).
    model = with_strategy(base, "every block", args.segments)
    plain_calls, plain = rng_stashes(with_strategy(base, "none", args.segments), x,
                                     training=False, grad=False)
    for grad in (False, True):
        for training in (False, True):
            calls, logits = rng_stashes(model, x, training, grad)
            metrics.write(event="guarded_forward", training=training, grad=grad,
                          rng_stashes=calls, blocks=cfg.n_layer, plain_rng_stashes=plain_calls,
                          equal_to_plain=torch.equal(logits, plain) if not training else None)
            print(f"every block, forward {'with' if grad else 'without'} grad in "
                  f"{'training' if training else 'eval'} mode: {calls} RNG stashes")

    # The measurement's control: memory and FLOPs in one pass, as this script once did.
    for strategy in ("none", "every block"):
        model = with_strategy(base, strategy, args.segments)
        row = memory_pass(model, x, y, args.seed, device, FlopCounterMode(display=False))
        metrics.write(event="one_pass", strategy=strategy, peak_bytes=row["peak_bytes"])
        print(f"{strategy} measured under FlopCounterMode too: peak "
              f"{row['peak_bytes'] / 2**20:.2f} MiB")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
