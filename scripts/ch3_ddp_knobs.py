"""Measure DDP's performance knobs on the chapter's model, one experiment after another.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_ddp_knobs.py
    torchrun --standalone --nproc_per_node=2 scripts/ch3_ddp_knobs.py --experiments compression --model medium

Every experiment builds fresh DDP models from the same seed, on the model, batch size and data of
scripts/ch3_train.py, and changes one thing:

  buckets       step time and bucket count for a sweep of bucket_cap_mb values (on --sweep-model)
  accumulation  gradient accumulation with and without no_sync: all-reduces per optimizer step,
                step time, and whether the accumulated gradients agree
  precision     fp32 against bf16 autocast (and fp16 with GradScaler when the device is CUDA)
  options       gradient_as_bucket_view and static_graph: gradient memory, step time, same weights?
  buffers       forward_sync_buffers (formerly broadcast_buffers) on a model with BatchNorm statistics
  compression   fp16_compress_hook and bf16_compress_hook: bytes handed to all_reduce, gradient error

Rank 0 prints a table per experiment and writes one JSON line per measurement to --metrics.
Step times are medians over --steps steps, as seen by the slowest rank.
"""

import argparse
import statistics
import time
from contextlib import nullcontext
from itertools import cycle

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_float, positive_int, run_main, script_parser
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.ddp_inspect import bucket_sizes
from dtbook.distributed import ddp_device_ids, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES

EXPERIMENTS = ["buckets", "accumulation", "precision", "options", "buffers", "compression"]
WARMUP_STEPS = 2  # the first step differs: DDP lays its buckets out again once it has seen gradient order


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--experiments", nargs="+", choices=EXPERIMENTS, default=EXPERIMENTS, metavar="NAME",
                        help=f"which experiments to run (default: all of {', '.join(EXPERIMENTS)})")
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small",
                        help="model size for every experiment but the bucket sweep (default: small, as ch3_train.py)")
    parser.add_argument("--sweep-model", choices=sorted(MODEL_SIZES), default="medium",
                        help="model size for the bucket sweep; it needs gradients of a few MiB (default: medium)")
    parser.add_argument("--bucket-caps", nargs="+", type=positive_float, metavar="MiB",
                        default=[0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 25.0],
                        help="bucket_cap_mb values (in MiB) for the sweep; DDP's default is always added")
    parser.add_argument("--bucket-cap-mb", type=positive_float, default=25.0,
                        help="bucket size in MiB for every experiment but the sweep (default 25, as ch3_train.py)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="samples per process per step (default 16)")
    parser.add_argument("--accum-steps", type=positive_int, default=4,
                        help="micro-batches per optimizer step in the accumulation experiment (default 4)")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per configuration (default 5)")
    parser.add_argument("--precision-steps", type=positive_int, default=30,
                        help="training steps per precision, for the loss curves (default 30, at least 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    add_backend_and_metrics(parser)
    args = parser.parse_args()
    if args.precision_steps < 2:
        raise ScriptError(f"--precision-steps must be at least 2 (the first step is not timed), "
                          f"got {args.precision_steps}")
    return args


class Session:
    """What every experiment needs: the device, this rank's batches, and where to write results."""

    def __init__(self, args, backend, device):
        self.args = args
        self.device = device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.metrics = open_metrics(args.metrics, backend, device)
        self.batches = self.rank_batches(count=max(args.accum_steps, 4))

    def rank_batches(self, count):
        """The first ``count`` batches this rank sees in ch3_train.py's first epoch (different on every rank)."""
        cfg = MODEL_SIZES[self.args.model]
        dataset = corpus_windows(DEFAULTS.corpus_tokens, cfg.vocab_size, cfg.context, self.args.seed)
        return first_batches(dataset, self.args.batch_size, self.rank, self.world_size, self.args.seed, count,
                             self.device)

    def build_ddp(self, model_name, **ddp_options):
        """A fresh DDP model with ch3_train.py's bucket size unless ``ddp_options`` says otherwise."""
        ddp_options = {"bucket_cap_mb": self.args.bucket_cap_mb, **ddp_options}
        torch.manual_seed(self.args.seed)  # identical weights on every rank and in every configuration
        model = GPT(MODEL_SIZES[model_name]).to(self.device)
        device_ids = ddp_device_ids(self.device)
        ddp = DDP(model, device_ids=device_ids, **ddp_options)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=DEFAULTS.lr)

    def training_step(self, ddp, optimizer, amp_dtype=None, scaler=None):
        """One ch3_train.py optimizer step as a function: forward under autocast, backward, step."""
        data = cycle(self.batches)

        def step() -> float:
            x, y = next(data)
            with torch.autocast(self.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = ddp(x, y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            optimizer.zero_grad()
            return loss.item()

        return step

    def timed(self, fn, repeats):
        """Call ``fn`` ``repeats`` times; return its results and the wall time of each call in ms."""
        results, times = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            results.append(fn())
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append((time.perf_counter() - start) * 1000)
        return results, times

    def slowest_median(self, times_ms) -> float:
        """Median over this rank's calls, then the largest median over ranks: the job runs at its slowest rank."""
        median = torch.tensor([statistics.median(times_ms)], device=self.device)
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
        return median.item()

    def median_step_ms(self, step, steps) -> float:
        for _ in range(WARMUP_STEPS):
            step()
        dist.barrier()
        return self.slowest_median(self.timed(step, steps)[1])

    def record(self, event, **fields):
        self.metrics.write(event=event, **fields)

    def say(self, text):
        if self.rank == 0:
            print(text, flush=True)


class BucketLog:
    """Comm-hook state: notes every bucket DDP hands over, then lets ``hook`` all-reduce it."""

    def __init__(self, hook):
        self.hook = hook
        self.calls = []  # (data_ptr, bytes, elements) of each bucket buffer, in call order


def logged_hook(log: BucketLog, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    log.calls.append((buffer.data_ptr(), buffer.numel() * buffer.element_size(), buffer.numel()))
    return log.hook(None, bucket)  # None: the default process group


def grads_of(ddp) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in ddp.parameters()]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------
# The experiments
# --------------------------------------------------------------------------


def sweep_buckets(s: Session) -> None:
    """Smaller buckets start all-reducing earlier but pay a fixed cost per all-reduce; find the balance."""
    s.say(f"\n== buckets: step time against bucket_cap_mb ({s.args.sweep_model} model)")
    s.say(f"{'bucket_cap_mb':>14} {'buckets':>7} {'largest MiB':>11} {'step ms':>8}")
    for cap in [*s.args.bucket_caps, None]:
        options = {"bucket_cap_mb": cap}  # None: DDP's default layout
        ddp, optimizer = s.build_ddp(s.args.sweep_model, **options)
        step_ms = s.median_step_ms(s.training_step(ddp, optimizer), s.args.steps)
        sizes = bucket_sizes(ddp)
        s.record("buckets", model=s.args.sweep_model, cap_mb=cap, buckets=len(sizes), bucket_bytes=sizes,
                 step_ms=step_ms)
        label = "default" if cap is None else f"{cap:g}"
        s.say(f"{label:>14} {len(sizes):>7} {max(sizes) / 2**20:>11.3f} {step_ms:>8.1f}")


def compare_accumulation(s: Session) -> None:
    """Accumulate K micro-batches: all-reduce after each, or only after the last one (no_sync)."""
    accum = s.args.accum_steps
    micro_batches = s.batches[:accum]
    s.say(f"\n== accumulation: {accum} micro-batches of {s.args.batch_size} per optimizer step")
    results = {}
    for skip_sync in (False, True):
        log = BucketLog(default_hooks.allreduce_hook)
        ddp, optimizer = s.build_ddp(s.args.model)
        ddp.register_comm_hook(log, logged_hook)

        def accumulate(ddp=ddp, skip_sync=skip_sync):
            for i, (x, y) in enumerate(micro_batches):
                last = i == accum - 1
                # Inside no_sync DDP's hooks only accumulate locally; the backward after it reduces the sum.
                with ddp.no_sync() if skip_sync and not last else nullcontext():
                    (ddp(x, y) / accum).backward()

        def optimizer_step(optimizer=optimizer, accumulate=accumulate):
            accumulate()
            optimizer.step()
            optimizer.zero_grad()

        optimizer_step()  # settles the bucket layout, so the counts below are for the steady state
        log.calls.clear()
        accumulate()
        all_reduces = len(log.calls)
        grads = grads_of(ddp)
        optimizer.zero_grad()
        step_ms = s.median_step_ms(optimizer_step, s.args.steps)
        results[skip_sync] = grads
        mode = "no_sync" if skip_sync else "sync every micro-batch"
        s.record("accumulation", mode=mode, accum_steps=accum, batch_size=s.args.batch_size,
                 buckets=len(bucket_sizes(ddp)), all_reduces_per_optimizer_step=all_reduces, step_ms=step_ms)
        s.say(f"{mode:>24}: {all_reduces} all-reduce call(s) per optimizer step, "
              f"{len(bucket_sizes(ddp))} bucket(s), {step_ms:.1f} ms per optimizer step")
    # The control is the classic mistake: every micro-batch inside no_sync, the last one too, so the
    # gradients are never all-reduced and each rank steps on its own. Rounding must stay far below it.
    ddp, _ = s.build_ddp(s.args.model)
    with ddp.no_sync():
        for x, y in micro_batches:
            (ddp(x, y) / accum).backward()
    never_reduced = grads_of(ddp)
    scale = max(g.abs().max().item() for g in results[False])
    difference = max_difference(results[False], results[True])
    control = max_difference(results[False], never_reduced)
    s.record("accumulation_grads", max_abs_difference=difference, max_abs_grad=scale,
             relative_difference=difference / scale, bitwise_equal=difference == 0.0,
             control_relative_difference=control / scale)
    s.say(f"accumulated gradients, no_sync against sync every micro-batch: largest difference "
          f"{difference:.2e} ({difference / scale:.1e} of the largest gradient entry, {scale:.2e}); "
          f"never all-reduced (the bug): {control / scale:.1e} of it")


def compare_precision(s: Session) -> None:
    """Autocast runs matmuls in a 16-bit type; the weights and the optimizer stay in fp32."""
    s.say(f"\n== precision: {s.args.precision_steps} training steps each")
    modes = [("fp32", None, None), ("bf16 autocast", torch.bfloat16, None)]
    if s.device.type == "cuda":
        # fp16's narrow exponent range makes small gradients underflow, so the loss is scaled up first.
        modes.append(("fp16 autocast + GradScaler", torch.float16, torch.amp.GradScaler("cuda")))
    else:
        s.record("precision_skipped", mode="fp16 autocast + GradScaler",
                 reason="fp16 with loss scaling is the CUDA recipe; on CPU the low-precision type is bf16")
        s.say("fp16 autocast + GradScaler: not run, this is a CPU run (the script runs it on CUDA)")
    for name, dtype, scaler in modes:
        ddp, optimizer = s.build_ddp(s.args.model)
        losses, times = s.timed(s.training_step(ddp, optimizer, dtype, scaler), s.args.precision_steps)
        step_ms = s.slowest_median(times[1:])
        s.record("precision", mode=name, losses=losses, step_ms=step_ms)
        s.say(f"{name:>28}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, {step_ms:.1f} ms per step")


def compare_options(s: Session) -> None:
    """gradient_as_bucket_view and static_graph change how DDP works, never what it computes."""
    s.say("\n== DDP options: gradient memory, step time, and the weights after the same steps")
    configurations = {"default": {}, "gradient_as_bucket_view=True": {"gradient_as_bucket_view": True},
                      "static_graph=True": {"static_graph": True}}
    reference = None
    for name, options in configurations.items():
        log = BucketLog(default_hooks.allreduce_hook)
        ddp, optimizer = s.build_ddp(s.args.model, **options)
        ddp.register_comm_hook(log, logged_hook)
        step = s.training_step(ddp, optimizer)
        step_ms = s.median_step_ms(step, s.args.steps)

        # One more backward, then ask of every gradient: does its memory lie inside a bucket buffer?
        log.calls.clear()
        x, y = s.batches[0]
        ddp(x, y).backward()
        buffers = [(ptr, nbytes) for ptr, nbytes, _ in log.calls]
        inside = [any(start <= p.grad.data_ptr() < start + size for start, size in buffers) for p in ddp.parameters()]
        grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in ddp.parameters())
        separate_bytes = sum(p.grad.numel() * p.grad.element_size()
                             for p, shared in zip(ddp.parameters(), inside, strict=True) if not shared)
        bucket_bytes = sum(nbytes for _, nbytes in buffers)
        optimizer.zero_grad()

        weights = [p.detach().clone() for p in ddp.parameters()]
        reference = reference or weights
        difference = max_difference(reference, weights)
        s.record("options", config=name, step_ms=step_ms, grads_in_buckets=sum(inside), params=len(inside),
                 grad_bytes=grad_bytes, bucket_bytes=bucket_bytes, gradient_memory_bytes=bucket_bytes + separate_bytes,
                 max_weight_difference=difference)
        s.say(f"{name:>30}: {sum(inside)}/{len(inside)} grads inside a bucket, gradient memory "
              f"{(bucket_bytes + separate_bytes) / 2**20:.2f} MiB, {step_ms:.1f} ms/step, "
              f"weights differ from default by {difference:.1e}")


class NormedMLP(nn.Module):
    """A model with buffers: BatchNorm keeps running statistics of the batches it has seen."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x))))


def compare_buffer_sync(s: Session, steps: int = 3) -> None:
    """DDP averages gradients; buffers it can only copy from rank 0 at the start of each forward, or leave alone."""
    s.say("\n== buffers: BatchNorm running_mean at the start of each forward, compared across ranks")
    gpt_buffers = len(list(GPT(MODEL_SIZES[s.args.model]).buffers()))
    for sync in (True, False):
        torch.manual_seed(s.args.seed)
        net = NormedMLP().to(s.device)
        device_ids = ddp_device_ids(s.device)
        # forward_sync_buffers is torch 2.13's name for what older code calls broadcast_buffers.
        ddp = DDP(net, device_ids=device_ids, forward_sync_buffers=sync)
        seen = []
        net.norm.register_forward_pre_hook(lambda module, inputs, seen=seen: seen.append(module.running_mean.clone()))
        data = torch.Generator().manual_seed(s.args.seed + s.rank)
        for _ in range(steps):
            x = (torch.randn(32, 8, generator=data) + s.rank).to(s.device)  # every rank sees different data
            ddp(x).sum().backward()
        seen.append(net.norm.running_mean.clone())
        everyone = [torch.empty_like(torch.stack(seen)) for _ in range(s.world_size)]
        dist.all_gather(everyone, torch.stack(seen))
        equal = [all(torch.equal(other[i], everyone[0][i]) for other in everyone) for i in range(len(seen))]
        s.record("buffers", forward_sync_buffers=sync, equal_at_forward_start=equal[:-1],
                 equal_after_last_forward=equal[-1], gpt_buffers=gpt_buffers)
        s.say(f"forward_sync_buffers={sync!s:>5}: same on all ranks at the start of forward 1..{steps}: "
              f"{equal[:-1]}; after the last forward: {equal[-1]}")
    s.say(f"the {s.args.model} GPT has {gpt_buffers} buffers, so for ch3_train.py this flag changes nothing")


def compare_compression(s: Session) -> None:
    """A compression hook casts each bucket to 16 bits for the all-reduce, then back to fp32."""
    s.say("\n== compression hooks: bytes handed to all_reduce per step and gradient error")
    hooks = {"allreduce_hook (fp32)": (default_hooks.allreduce_hook, None),
             "fp16_compress_hook": (default_hooks.fp16_compress_hook, torch.float16),
             "bf16_compress_hook": (default_hooks.bf16_compress_hook, torch.bfloat16)}
    reference = None
    for name, (hook, wire_dtype) in hooks.items():
        log = BucketLog(hook)
        ddp, optimizer = s.build_ddp(s.args.model)
        ddp.register_comm_hook(log, logged_hook)
        x, y = s.batches[0]
        ddp(x, y).backward()  # settles the bucket layout
        optimizer.zero_grad()
        log.calls.clear()
        ddp(x, y).backward()
        grads = torch.cat([g.flatten() for g in grads_of(ddp)])
        optimizer.zero_grad()
        buckets = len(log.calls)
        wire_bytes = sum(elements * (wire_dtype.itemsize if wire_dtype else 4) for _, _, elements in log.calls)
        reference = grads if reference is None else reference
        error = grads - reference
        relative_error = (error.norm() / reference.norm()).item()
        step_ms = s.median_step_ms(s.training_step(ddp, optimizer), s.args.steps)
        s.record("compression", hook=name, bytes_per_step=wire_bytes, buckets=buckets,
                 max_abs_error=error.abs().max().item(), relative_error=relative_error,
                 max_abs_grad=reference.abs().max().item(), step_ms=step_ms)
        s.say(f"{name:>22}: {wire_bytes / 2**20:.3f} MiB per step in {buckets} bucket(s), "
              f"relative error {relative_error:.2e}, {step_ms:.1f} ms/step")


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    session = Session(args, backend, device)
    session.record("config", model=args.model, sweep_model=args.sweep_model, batch_size=args.batch_size,
                   context=MODEL_SIZES[args.model].context, optimizer="AdamW", lr=DEFAULTS.lr,
                   bucket_cap_mb=args.bucket_cap_mb)
    session.say(f"{session.world_size} process(es), {args.model} model, batch {args.batch_size} per process")

    run = {"buckets": sweep_buckets, "accumulation": compare_accumulation, "precision": compare_precision,
           "options": compare_options, "buffers": compare_buffer_sync, "compression": compare_compression}
    for name in EXPERIMENTS:
        if name in args.experiments:
            run[name](session)
    session.metrics.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
