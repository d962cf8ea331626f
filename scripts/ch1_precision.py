"""Mixed precision on one device: bf16 and fp16 autocast against fp32, and what GradScaler does.

    python scripts/ch1_precision.py
    python scripts/ch1_precision.py --model medium --steps 100
    torchrun --standalone --nproc_per_node=1 scripts/ch1_precision.py

1. curves   the same model, seed and batches trained in fp32, with bf16 autocast, and with fp16
            autocast plus a GradScaler: the loss of every step and the median step time
2. dtypes   which ATen ops ran in which dtype during one bf16 autocast step (a dispatch mode
            watches), and the dtypes of the parameters and their gradients: the master weights
3. underflow  the fp32-trained model's gradient of the logits, its tokens weighed as in a batch of
            --tokens-per-batch, computed under fp16 autocast with and without a loss scale, and
            the fp32 gradient rounded to fp16
4. scaler   --scaler-steps of fp16 training with a GradScaler that starts at --init-scale and
            grows every --growth-interval clean steps; at step --inject-inf-at one gradient is set
            to inf, as an overflow would: every step records its scale and whether it was skipped

torch.cuda.amp.autocast and torch.cuda.amp.GradScaler are deprecated: torch.autocast(device_type)
and torch.amp.GradScaler(device_type) serve CPU and CUDA with one code path, as used here.
"""

import argparse
import math
import warnings
from collections import Counter

import torch
import torch.distributed as dist

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_float, positive_int, run_main, script_parser
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import drain_gloo_workers, open_metrics, start_single_device
from dtbook.measure import AtenOps, median_ms
from dtbook.model import GPT, MODEL_SIZES

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16 = torch.finfo(torch.float16)
SMALLEST_FP16_SUBNORMAL = 2.0**-24  # below half of this, a value rounds to zero in fp16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_SIZES), default="small", help="model size (default: small)")
    add("--steps", type=positive_int, default=40, help="training steps per precision (default: 40)")
    add("--batch-size", type=positive_int, default=DEFAULTS.batch_size, help="windows per step (default: 16)")
    add("--lr", type=positive_float, default=DEFAULTS.lr, help="AdamW learning rate (default: 0.01)")
    add("--seed", type=int, default=DEFAULTS.seed, help="seeds the corpus and the weights")
    add("--loss-scale", type=positive_float, default=2.0**16,
        help="the fixed scale of the underflow experiment (default: 65536, GradScaler's initial scale)")
    add("--tokens-per-batch", type=positive_int, default=2**18,
        help="the underflow experiment weighs its tokens as in a batch of this many tokens, as large "
             "models train with (default: 262144)")
    add("--init-scale", type=positive_float, default=2.0**16,
        help="the scaler experiment's initial scale (default: 65536)")
    add("--growth-interval", type=positive_int, default=10,
        help="clean steps before the scaler doubles its scale (default: 10; GradScaler's is 2000)")
    add("--scaler-steps", type=positive_int, default=25,
        help="steps of the scaler experiment, at most --steps (default: 25)")
    add("--inject-inf-at", type=positive_int, default=5,
        help="the scaler experiment's step whose gradient is set to inf (default: 5)")
    add_backend_and_metrics(parser)
    args = parser.parse_args(argv)
    if args.tokens_per_batch < args.batch_size * MODEL_SIZES[args.model].context:
        parser.error(f"--tokens-per-batch must be at least the {args.batch_size} x "
                     f"{MODEL_SIZES[args.model].context} tokens of one batch")
    if args.scaler_steps > args.steps:
        parser.error(f"--scaler-steps {args.scaler_steps} is more than the {args.steps} batches of --steps")
    if args.inject_inf_at > args.scaler_steps:
        parser.error(f"--inject-inf-at {args.inject_inf_at} is after the last of --scaler-steps "
                     f"{args.scaler_steps}")
    return args


def build(args, device):
    torch.manual_seed(args.seed)
    model = GPT(MODEL_SIZES[args.model]).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


# --------------------------------------------------------------------------
# 1. The same training in three precisions
# --------------------------------------------------------------------------


def train(args, precision: str, batches, device):
    """Train from the seed on ``batches``; return the model, losses and median step
    time.

    With fp16 the loss is multiplied by the scaler's scale before backward, and
    scaler.step unscales the gradients, skipping the step if any is inf or NaN. bf16
    has fp32's exponent range and needs no scaler: GradScaler(enabled=False) passes
    through.
    """
    model, optimizer = build(args, device)
    dtype = PRECISIONS[precision]
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    losses = []

    def step(x, y):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    data = iter(batches)
    step_ms = median_ms(lambda: step(*next(data)), len(batches) - 1, device)
    return model, losses, step_ms


# --------------------------------------------------------------------------
# 2. Which dtype each op ran in
# --------------------------------------------------------------------------


def op_dtypes(args, x, y, device) -> dict:
    """One bf16 autocast forward and backward: the ops of the forward, and the dtypes that remain."""
    model, _ = build(args, device)
    ops = AtenOps()
    with ops, torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    weight = model.blocks[0].qkv.weight
    return {
        "forward_ops": [{"op": op, "dtype": dtype, "calls": n}
                        for (op, dtype), n in sorted(Counter(ops.calls).items())],
        "loss_dtype": str(loss.dtype),
        "weight_dtype": str(weight.dtype),
        "grad_dtype": str(weight.grad.dtype),
    }


def number_formats() -> dict[str, dict]:
    """Range and precision of the three formats, as torch.finfo reports them."""
    formats = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        info = torch.finfo(dtype)
        formats[name] = {"bits": info.bits, "mantissa_bits": round(-math.log2(info.eps)),
                         "max": info.max, "smallest_normal": info.tiny, "eps": info.eps}
    return formats


def legacy_api_warnings() -> list[str]:
    """What the old torch.cuda.amp spelling says when it is used."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.amp.GradScaler()
        with torch.cuda.amp.autocast():
            pass
    return [f"{w.category.__name__}: {w.message}" for w in caught]


# --------------------------------------------------------------------------
# 3. fp16 gradients underflow
# --------------------------------------------------------------------------


def logits_gradient(model, x, y, dtype, scale: float) -> torch.Tensor:
    """d(scale * mean loss)/d(logits), in the dtype autograd computed it in."""
    captured = []

    def keep_gradient(module, inputs, logits):
        logits.register_hook(captured.append)

    handle = model.head.register_forward_hook(keep_gradient)
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        loss = model(x, y)
    (loss * scale).backward()
    handle.remove()
    model.zero_grad(set_to_none=True)
    return captured[0]


def log2_histogram(magnitudes: torch.Tensor, bins: int) -> dict:
    """Counts and edges of ``bins`` equal bins from the smallest value to the largest.

    torch.histc, not torch.histogram: histogram has no CUDA kernel and raised
    NotImplementedError on a GPU; histc runs on both, and bins the same way.
    """
    low, high = magnitudes.min().item(), magnitudes.max().item()
    counts = torch.histc(magnitudes, bins=bins, min=low, max=high)
    edges = torch.linspace(low, high, bins + 1, dtype=torch.float64)
    return {"log2_abs_gradient": counts.tolist(),
            "log2_abs_gradient_edges": edges.tolist()}


def underflow(model, x, y, scale: float, tokens_per_batch: int) -> dict:
    """How many entries of the logits' gradient fp16 turns into zero, with and without a scale.

    The mean loss over N tokens gives each token's logits a gradient of (probability - target) / N.
    These tokens are weighed as part of a batch of ``tokens_per_batch``: loss x (tokens / that).
    """
    weight = x.numel() / tokens_per_batch
    reference = logits_gradient(model, x, y, None, weight)
    unscaled = logits_gradient(model, x, y, torch.float16, weight)
    scaled = logits_gradient(model, x, y, torch.float16, weight * scale)
    nonzero = reference != 0
    magnitudes = torch.log2(reference[nonzero].abs().double())

    def rounded(values):  # the fp32 gradient, rounded to fp16 and back
        return values.half().float()

    return {
        "scale": scale,
        "dtype_in_backward": str(unscaled.dtype),
        "entries": reference.numel(),
        "reference_zero_fraction": 1 - nonzero.float().mean().item(),
        "zero_fraction_unscaled": (unscaled == 0).float().mean().item(),
        "zero_fraction_scaled": (scaled == 0).float().mean().item(),
        "below_fp16_normal_fraction": (reference.abs() < FP16.tiny).float().mean().item(),
        "rounded_zero_fraction_unscaled": (rounded(reference)[nonzero] == 0).float().mean().item(),
        "rounded_zero_fraction_scaled": (rounded(reference * scale)[nonzero] == 0).float().mean().item(),
        **log2_histogram(magnitudes, bins=60),
        "fp16_smallest_normal": FP16.tiny,
        "fp16_smallest_subnormal": SMALLEST_FP16_SUBNORMAL,
        "fp16_max": FP16.max,
    }


# --------------------------------------------------------------------------
# 4. The scaler's bookkeeping
# --------------------------------------------------------------------------


def scaler_run(args, batches, device) -> list[dict]:
    """fp16 training that records each step's scale and whether the step was
    skipped."""
    model, optimizer = build(args, device)
    scaler = torch.amp.GradScaler(device.type, init_scale=args.init_scale,
                                  growth_interval=args.growth_interval)
    rows = []
    for step, (x, y) in enumerate(batches, start=1):
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        injected = step == args.inject_inf_at
        if injected:  # what an overflow in backward leaves behind
            model.blocks[0].mlp[0].weight.grad.view(-1)[0] = math.inf
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        # unscales; skips optimizer.step() if it finds inf or NaN
        scaler.step(optimizer)
        # halves the scale after a skip, doubles it after clean steps
        scaler.update()
        after = model.parameters()
        changed = any(not torch.equal(b, p)
                      for b, p in zip(before, after, strict=True))
        optimizer.zero_grad(set_to_none=True)
        rows.append({"step": step, "scale": scale, "next_scale": scaler.get_scale(),
                     "weights_changed": changed, "loss": loss.item(),
                     "injected": injected})
    return rows


# --------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    backend, device = start_single_device(args.backend)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ScriptError("this GPU has no bf16 support, which the bf16 runs need")
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    dataset = corpus_windows(DEFAULTS.corpus_tokens, cfg.vocab_size, cfg.context, args.seed)
    batches = first_batches(dataset, args.batch_size, 0, 1, args.seed, args.steps, device)

    print(f"{args.model} model, {args.steps} steps of {args.batch_size} windows, on {device}")
    models = {}
    for precision in PRECISIONS:
        models[precision], losses, step_ms = train(args, precision, batches, device)
        metrics.write(event="curve", precision=precision, losses=losses, step_ms=step_ms)
        print(f"  {precision}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, median step {step_ms:.1f} ms")

    dtypes = op_dtypes(args, *batches[0], device)
    metrics.write(event="dtypes", **dtypes, formats=number_formats(), legacy_warnings=legacy_api_warnings())
    print(f"bf16 autocast: weights {dtypes['weight_dtype']}, their gradients {dtypes['grad_dtype']}, "
          f"loss {dtypes['loss_dtype']}")

    x, y = batches[0]
    found = underflow(models["fp32"], x, y, args.loss_scale, args.tokens_per_batch)
    metrics.write(event="underflow", tokens=x.numel(), tokens_per_batch=args.tokens_per_batch, **found)
    print(f"gradient of the logits in {found['dtype_in_backward']}: "
          f"{found['zero_fraction_unscaled']:.2%} of entries are zero without a scale, "
          f"{found['zero_fraction_scaled']:.2%} with scale {args.loss_scale:g} "
          f"(fp32: {found['reference_zero_fraction']:.2%})")

    for row in scaler_run(args, batches[: args.scaler_steps], device):
        metrics.write(event="scaler_step", **row)
        if row["injected"] or row["next_scale"] != row["scale"]:
            print(f"  step {row['step']:>3}: scale {row['scale']:g} -> {row['next_scale']:g}"
                  f"{', weights unchanged (step skipped)' if not row['weights_changed'] else ''}")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
