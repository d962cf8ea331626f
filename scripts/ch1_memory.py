"""Where the memory of a training step goes: parameters, gradients, optimizer state, activations.

    python scripts/ch1_memory.py                                    # small and medium, fp32 and bf16
    python scripts/ch1_memory.py --models medium large --batch-size 8
    torchrun --standalone --nproc_per_node=1 scripts/ch1_memory.py   # the same under torchrun

For each model size and precision the script runs one AdamW step of the book's GPT and counts the
bytes of each kind of tensor as the step creates it:

  parameters        every parameter storage once (the output head shares the embedding's)
  activations       what autograd saves for backward, seen by a saved_tensors_hooks pack hook
  gradients         the .grad of every parameter after backward
  optimizer state   AdamW's exp_avg, exp_avg_sq and step, created by the first optimizer.step()

and prints them beside the formulas. torch's own tracker (MemTracker) watches the same step and
reports the peak, temporaries included. Then the batch size and the sequence length are swept:
activations grow, parameters do not. On CUDA the script also reads torch.cuda.memory_allocated
after each phase and max_memory_allocated, and records an allocator snapshot of one step
(--snapshot saves it for https://pytorch.org/memory_viz), summarised offline with
torch.cuda._memory_viz. Memory is counted in tensor bytes, never as the process's RSS.
"""

import argparse
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import drain_gloo_workers, open_metrics, start_single_device
from dtbook.measure import SavedTensors, gradient_bytes, optimizer_state_bytes, parameter_bytes
from dtbook.model import GPT, MODEL_SIZES, GPTConfig

AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16}
KINDS = ["parameters", "gradients", "optimizer_state", "activations"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--models", nargs="+", choices=sorted(MODEL_SIZES), default=["small", "medium"],
        help="model sizes to account for (default: small medium)")
    add("--precisions", nargs="+", choices=sorted(AMP_DTYPES), default=["fp32", "bf16"],
        help="fp32, and/or bf16 autocast with fp32 master weights (default: both)")
    add("--batch-size", type=positive_int, default=DEFAULTS.batch_size,
        help="windows per step (default: 16, as ch3_train.py)")
    add("--batch-sizes", nargs="+", type=positive_int, default=[1, 2, 4, 8, 16, 32],
        help="the batch-size sweep, at the model's context length")
    add("--seq-lens", nargs="+", type=positive_int, default=[16, 32, 64, 128, 256],
        help="the sequence-length sweep, at --batch-size")
    add("--sweep-model", choices=sorted(MODEL_SIZES), default="small", help="model of both sweeps")
    add("--seed", type=int, default=DEFAULTS.seed, help="seeds the corpus and the weights")
    add("--snapshot", help="CUDA only: also write the allocator snapshot of one step to this file")
    add_backend_and_metrics(parser)
    return parser.parse_args(argv)


# --------------------------------------------------------------------------
# The formulas
# --------------------------------------------------------------------------


def state_formula(n_params: int, n_tensors: int) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW state, whatever the autocast dtype.

    torch.amp keeps the parameters in fp32 (they are the master weights), so their gradients
    are fp32 too; AdamW adds two fp32 moments per parameter and a float32 step count per tensor.
    """
    return {"parameters": 4 * n_params, "gradients": 4 * n_params,
            "optimizer_state": 8 * n_params + 4 * n_tensors}


def activation_formula(cfg: GPTConfig, batch: int, seq_len: int,
                       precision: str) -> dict[str, int]:
    """What autograd saves in one forward pass of the book's GPT on the CPU, in
    bytes.

    Per block, in units of B x T x C values: the residual stream entering each layer
    norm (2, kept in fp32), the two layer-norm outputs (2), qkv (3), the attention
    output (1), the MLP's hidden layer before and after GELU (4 + 4). Under bf16
    autocast the matmuls' inputs and outputs are bf16, and the bf16 copies of the
    weights are saved too.
    """
    b, t, c, h, v = batch, seq_len, cfg.n_embd, cfg.n_head, cfg.vocab_size
    n_layer, bt, btc = cfg.n_layer, b * t, b * t * c
    # bytes of a matmul's input or output value
    low = 2 if precision == "bf16" else 4
    # Two layer norms keep a mean and 1/std per row; attention one log-sum-exp per
    # head.
    statistics = n_layer * (4 * bt + b * h * t) * 4
    terms = {
        "residual stream into 2 layer norms per block (fp32)": n_layer * 2 * btc * 4,
        "matmul inputs and outputs, 14 BTC per block": n_layer * 14 * btc * low,
        "layer-norm statistics and attention logsumexp": statistics,
        "final layer norm (input, output, statistics)": btc * (4 + low) + 2 * bt * 4,
        "log-softmax of the logits (BTV, fp32)": bt * v * 4,
        "token ids, targets, positions (int64), loss weight": 8 * (2 * bt + t) + 4,
    }
    if precision == "bf16":
        weights = n_layer * 12 * c * c + v * c
        terms["bf16 copies of the weights (12 C^2 per block + VC)"] = weights * 2
    return terms


# --------------------------------------------------------------------------
# Measuring one step
# --------------------------------------------------------------------------


def build(cfg: GPTConfig, seed: int, device: torch.device):
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=DEFAULTS.lr)


def first_batch(cfg: GPTConfig, args, device: torch.device):
    """The first batch ch3_train.py trains on: windows of the book's synthetic corpus."""
    dataset = corpus_windows(DEFAULTS.corpus_tokens, cfg.vocab_size, cfg.context, args.seed)
    [(x, y)] = first_batches(dataset, args.batch_size, 0, 1, args.seed, 1, device)
    return x, y


def cuda_allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def measure_step(cfg: GPTConfig, precision: str, x, y, seed: int,
                 device: torch.device, track_peaks: bool = True) -> dict:
    """One training step that counts each kind of tensor after the phase that makes
    it.

    With ``track_peaks``, two more steps run under MemTracker for their peak: one
    with the old gradients kept (zeroed in place), one with them freed
    (set_to_none=True).
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = cuda_allocated(device)
    model, optimizer = build(cfg, seed, device)
    amp = AMP_DTYPES[precision]
    autocast = torch.autocast(device.type, dtype=amp, enabled=amp is not None)
    cuda = {"after building the model": cuda_allocated(device)}
    with autocast, SavedTensors(exclude=model.parameters()) as saved:
        loss = model(x, y)
    cuda["after forward"] = cuda_allocated(device)
    loss.backward()
    cuda["after backward"] = cuda_allocated(device)
    optimizer.step()
    cuda["after optimizer.step"] = cuda_allocated(device)
    first = next(model.parameters())
    record = {
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_param_tensors": len(list(model.parameters())),
        "parameters": parameter_bytes(model),
        "activations": saved.bytes,
        "activations_by_dtype": saved.bytes_by_dtype(),
        "gradients": gradient_bytes(model),
        "optimizer_state": optimizer_state_bytes(optimizer),
        "param_dtype": str(first.dtype), "grad_dtype": str(first.grad.dtype),
    }
    if device.type == "cuda":
        record["cuda_max_allocated"] = (
            torch.cuda.max_memory_allocated(device) - before)
    for set_to_none in (False, True):
        optimizer.zero_grad(set_to_none=set_to_none)
        key = "set_to_none" if set_to_none else "zeroed_in_place"
        record[f"gradients_between_steps_{key}"] = gradient_bytes(model)
        if device.type == "cuda":
            cuda[f"after zero_grad(set_to_none={set_to_none})"] = (
                cuda_allocated(device))
        if not track_peaks:
            continue
        # A fresh tracker for each step: it registers the parameters, gradients and
        # optimizer state that exist now, then follows every tensor the step creates.
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            with autocast:
                loss = model(x, y)
            loss.backward()
            optimizer.step()
        peak = tracker.get_tracker_snapshot("peak")[device]
        record[f"memtracker_peak_{key}"] = tracker_categories(peak)
    if device.type == "cuda":
        record["cuda_allocated"] = {phase: n - before for phase, n in cuda.items()}
    return record


def tracker_categories(snapshot: dict) -> dict[str, int]:
    """MemTracker's snapshot of one device as {"PARAM": bytes, ..., "Total": bytes}."""
    return {getattr(kind, "name", kind): size for kind, size in snapshot.items()}


def activation_sweep(cfg: GPTConfig, sizes: list[tuple[int, int]], seed: int, device) -> list[dict]:
    """Saved bytes of one forward pass for each (batch, seq_len), always on the same model."""
    model, _ = build(cfg, seed, device)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for batch, seq_len in sizes:
        x, y = (torch.randint(cfg.vocab_size, (batch, seq_len), generator=gen).to(device) for _ in "xy")
        with SavedTensors(exclude=model.parameters()) as saved:
            model(x, y)
        rows.append({"batch": batch, "seq_len": seq_len, "parameters": parameter_bytes(model),
                     "activations": saved.bytes,
                     "formula": sum(activation_formula(cfg, batch, seq_len, "fp32").values())})
    return rows


# --------------------------------------------------------------------------
# CUDA only: the allocator's own record of one step
# --------------------------------------------------------------------------


def allocation_curve(snapshot: dict, device_index: int, max_points: int = 2000) -> list[int]:
    """Bytes allocated after each alloc/free in the snapshot's trace: the line the viewer draws."""
    allocated, curve = 0, []
    for event in snapshot["device_traces"][device_index]:
        if event["action"] == "alloc":
            allocated += event["size"]
        elif event["action"] == "free_completed":
            allocated -= event["size"]
        else:
            continue
        curve.append(allocated)
    stride = max(1, len(curve) // max_points)
    return curve[::stride]


def segment_totals(snapshot: dict) -> dict[str, int]:
    """segsum's last lines as numbers: the allocator's segments, and their bytes."""
    segments = snapshot["segments"]
    reserved = sum(seg["total_size"] for seg in segments)
    allocated = sum(seg["allocated_size"] for seg in segments)
    return {"segments": len(segments), "reserved_bytes": reserved,
            "allocated_bytes": allocated, "free_bytes": reserved - allocated}


def record_cuda_snapshot(cfg, x, y, seed, device, path: str | None, metrics) -> None:
    """Record every allocation of one fp32 step, from before the model exists, and summarise it."""
    from torch.cuda import _memory_viz

    torch.cuda.memory._record_memory_history(max_entries=100_000)
    measure_step(cfg, "fp32", x, y, seed, device, track_peaks=False)
    if path:
        torch.cuda.memory._dump_snapshot(path)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    summary = _memory_viz.segsum(snapshot)
    print("\nallocator snapshot of one fp32 step (torch.cuda._memory_viz.segsum):")
    print("\n".join(summary.splitlines()[:12]))
    if path:
        print(f"snapshot written to {path}: drop it on https://pytorch.org/memory_viz, or run\n"
              f"  python -m torch.cuda._memory_viz trace_plot {path} -o {path}.html")
    metrics.write(event="cuda_snapshot", allocated=allocation_curve(snapshot, device.index),
                  path=path, **segment_totals(snapshot))


# --------------------------------------------------------------------------


def print_step_table(rows: list[dict]) -> None:
    mib = 2**20
    print(f"\n{'model':<7} {'prec':<5} {'params':>10} " + " ".join(f"{k:>16}" for k in KINDS)
          + f" {'activations by formula':>23}")
    for r in rows:
        print(f"{r['model']:<7} {r['precision']:<5} {r['n_params']:>10,} "
              + " ".join(f"{r[k] / mib:>12.3f} MiB" for k in KINDS)
              + f" {sum(r['activation_formula'].values()) / mib:>19.3f} MiB")


def main() -> None:
    args = parse_args()
    backend, device = start_single_device(args.backend)
    if args.snapshot and device.type != "cuda":
        raise ScriptError("--snapshot records the CUDA caching allocator; this run is on the CPU")
    if "bf16" in args.precisions and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ScriptError("this GPU has no bf16 support: use --precisions fp32")
    metrics = open_metrics(args.metrics, backend, device)

    rows = []
    for name in args.models:
        cfg = MODEL_SIZES[name]
        x, y = first_batch(cfg, args, device)
        for precision in args.precisions:
            # MemTracker follows every op in Python, which is slow: one precision is enough.
            record = measure_step(cfg, precision, x, y, args.seed, device,
                                  track_peaks=precision == args.precisions[0])
            record.update(model=name, precision=precision, batch=args.batch_size, seq_len=cfg.context,
                          config=dataclasses.asdict(cfg),
                          formula=state_formula(record["n_params"], record["n_param_tensors"]),
                          activation_formula=activation_formula(cfg, args.batch_size, cfg.context,
                                                                precision))
            metrics.write(event="step_memory", **record)
            rows.append(record)
    print_step_table(rows)

    # One model for both sweeps, with room for the longest sequence: its parameters never change.
    context = MODEL_SIZES[args.sweep_model].context
    sweep_cfg = dataclasses.replace(MODEL_SIZES[args.sweep_model], context=max(context, *args.seq_lens))
    sizes = [(b, context) for b in args.batch_sizes] + [(args.batch_size, t) for t in args.seq_lens]
    print(f"\nactivations of one forward pass of the {args.sweep_model} model (fp32)")
    print(f"{'batch':>6} {'seq':>5} {'parameters':>14} {'activations':>14}")
    for row in activation_sweep(sweep_cfg, sizes, args.seed, device):
        metrics.write(event="sweep", model=args.sweep_model, **row)
        print(f"{row['batch']:>6} {row['seq_len']:>5} {row['parameters'] / 2**20:>10.3f} MiB "
              f"{row['activations'] / 2**20:>10.3f} MiB")

    if device.type == "cuda":
        cfg = MODEL_SIZES[args.models[0]]
        record_cuda_snapshot(cfg, *first_batch(cfg, args, device), args.seed, device, args.snapshot,
                             metrics)
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
