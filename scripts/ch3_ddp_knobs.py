"""Measure DDP's performance knobs on the chapter's model, one experiment after another.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_ddp_knobs.py
    torchrun --standalone --nproc_per_node=2 scripts/ch3_ddp_knobs.py --experiments compression --model medium

Every experiment builds fresh DDP models from the same seed, on the model, batch size and data of
scripts/ch3_train.py, and changes one thing:

  buckets       step time and bucket count for a sweep of bucket_cap_mb values (on --sweep-model)
  accumulation  gradient accumulation with and without no_sync: all-reduces per optimizer step,
                step time, and whether the accumulated gradients agree
  precision     fp32 against bf16 autocast and fp16 autocast with a GradScaler
  scaling       GradScaler step by step: an overflow skips the step and halves the scale,
                clean steps grow it; one rank's overflow makes every rank skip; and why
                scaler.unscale_(optimizer) must come before clip_grad_norm_
  options       gradient_as_bucket_view and static_graph: gradient memory, step time, same weights?
  buffers       forward_sync_buffers (formerly broadcast_buffers) on a model with BatchNorm statistics
  compression   fp16_compress_hook, bf16_compress_hook and PowerSGD (rank 1): every tensor handed
                to dist.all_reduce (size, dtype), gradient error, and how far a few steps move the
                weights from fp32's; DDP's built-in reduction (no hook) is the run that must match

Rank 0 prints a table per experiment and writes one JSON line per measurement to --metrics.
A step's time is that of its slowest rank; tables show the median over --steps steps.
"""

import argparse
import math
import statistics
import time
from contextlib import nullcontext
from itertools import cycle

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_float, positive_int, run_main, script_parser
from dtbook.compare import training_gap
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.ddp_inspect import bucket_sizes
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group
from dtbook.model import GPT, MODEL_SIZES

EXPERIMENTS = ["buckets", "accumulation", "precision", "scaling", "options", "buffers",
               "compression"]
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
    parser.add_argument("--scaling-steps", type=positive_int, default=16,
                        help="fp16 steps in the GradScaler experiment (default 16)")
    parser.add_argument("--growth-interval", type=positive_int, default=4,
                        help="GradScaler growth_interval in that experiment (default 4; torch's is 2000)")
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
        self.backend, self.device = backend, device
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

    def slowest_times(self, times_ms) -> list[float]:
        """Each call's time on its slowest rank: a synchronized job waits for that one."""
        per_call = torch.tensor(times_ms, device=self.device)
        dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
        return per_call.tolist()

    def slowest_median(self, times_ms) -> float:
        return statistics.median(self.slowest_times(times_ms))

    def step_times_ms(self, step, steps) -> list[float]:
        """``steps`` timed calls of ``step`` after WARMUP_STEPS untimed ones."""
        for _ in range(WARMUP_STEPS):
            step()
        dist.barrier()
        return self.slowest_times(self.timed(step, steps)[1])

    def median_step_ms(self, step, steps) -> float:
        return statistics.median(self.step_times_ms(step, steps))

    def record(self, event, **fields):
        self.metrics.write(event=event, **fields)

    def say(self, text):
        if self.rank == 0:
            print(text, flush=True)


class BucketLog:
    """Comm-hook state: notes every bucket DDP hands over, then lets ``hook`` all-reduce it."""

    def __init__(self, hook, state=None):
        self.hook, self.state = hook, state  # state None: the default process group
        self.calls = []  # (data_ptr, bytes, elements) of each bucket buffer, in call order


def logged_hook(log: BucketLog, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    buffer = bucket.buffer()
    nbytes = buffer.numel() * buffer.element_size()
    log.calls.append((buffer.data_ptr(), nbytes, buffer.numel()))
    return log.hook(log.state, bucket)


class AllReduceLog:
    """Every tensor handed to ``dist.all_reduce`` while active, from any thread.

    The hooks call ``dist.all_reduce`` through the module attribute, and PowerSGD
    issues its P and Q all-reduces from future callbacks, which may run on the
    backend's thread; so the attribute itself is wrapped rather than a thread-local
    dispatch mode used. ``tensors`` holds (elements, bytes, dtype) of each call,
    in call order.
    """

    def __enter__(self):
        self.tensors, self._all_reduce = [], dist.all_reduce

        def recording(tensor, *args, **kwargs):
            self.tensors.append((tensor.numel(),
                                 tensor.numel() * tensor.element_size(),
                                 str(tensor.dtype).removeprefix("torch.")))
            return self._all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = recording
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._all_reduce


def grads_of(ddp) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in ddp.parameters()]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------
# The experiments
# --------------------------------------------------------------------------


def sweep_buckets(s: Session) -> None:
    """Small buckets start all-reducing earlier but pay a fixed cost per call."""
    s.say(f"\n== buckets: step time by bucket_cap_mb ({s.args.sweep_model} model)")
    s.say(f"{'bucket_cap_mb':>14} {'buckets':>7} {'largest MiB':>11} {'step ms':>8}")
    for cap in [*s.args.bucket_caps, None]:
        options = {"bucket_cap_mb": cap}  # None: DDP's default layout
        ddp, optimizer = s.build_ddp(s.args.sweep_model, **options)
        times = s.step_times_ms(s.training_step(ddp, optimizer), s.args.steps)
        step_ms = statistics.median(times)
        sizes = bucket_sizes(ddp)
        s.record("buckets", model=s.args.sweep_model, cap_mb=cap, buckets=len(sizes),
                 bucket_bytes=sizes, step_ms=step_ms, step_ms_all=times)
        label = "default" if cap is None else f"{cap:g}"
        largest = max(sizes) / 2**20
        s.say(f"{label:>14} {len(sizes):>7} {largest:>11.3f} {step_ms:>8.1f}")


def compare_accumulation(s: Session) -> None:
    """Accumulate K micro-batches: all-reduce after each, or only after the last."""
    accum = s.args.accum_steps
    micro_batches = s.batches[:accum]
    s.say(f"\n== accumulation: {accum} micro-batches of {s.args.batch_size} "
          "per optimizer step")
    results = {}
    for skip_sync in (False, True):
        log = BucketLog(default_hooks.allreduce_hook)
        ddp, optimizer = s.build_ddp(s.args.model)
        ddp.register_comm_hook(log, logged_hook)

        def accumulate(ddp=ddp, skip_sync=skip_sync):
            for i, (x, y) in enumerate(micro_batches):
                last = i == accum - 1
                # Inside no_sync, DDP's hooks only accumulate locally; the backward
                # after it reduces the sum.
                with ddp.no_sync() if skip_sync and not last else nullcontext():
                    (ddp(x, y) / accum).backward()

        def optimizer_step(optimizer=optimizer, accumulate=accumulate):
            accumulate()
            optimizer.step()
            optimizer.zero_grad()

        optimizer_step()  # settles the bucket layout: the counts below are steady
        log.calls.clear()
        accumulate()
        all_reduces = len(log.calls)
        grads = grads_of(ddp)
        optimizer.zero_grad()
        times = s.step_times_ms(optimizer_step, s.args.steps)
        step_ms = statistics.median(times)
        results[skip_sync] = grads
        mode = "no_sync" if skip_sync else "sync every micro-batch"
        buckets = len(bucket_sizes(ddp))
        s.record("accumulation", mode=mode, accum_steps=accum,
                 batch_size=s.args.batch_size, buckets=buckets,
                 all_reduces_per_optimizer_step=all_reduces, step_ms=step_ms,
                 step_ms_all=times)
        s.say(f"{mode:>24}: {all_reduces} all-reduce call(s) per optimizer step, "
              f"{buckets} bucket(s), {step_ms:.1f} ms per optimizer step")
    # The control is the classic mistake: every micro-batch inside no_sync, the last
    # one too, so the gradients are never all-reduced and each rank steps on its own.
    # Rounding must stay far below it.
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
    s.say(f"accumulated gradients, no_sync against sync every micro-batch: largest "
          f"difference {difference:.2e} ({difference / scale:.1e} of the largest "
          f"gradient entry, {scale:.2e}); never all-reduced (the bug): "
          f"{control / scale:.1e} of it")


def compare_precision(s: Session) -> None:
    """Autocast runs matmuls in a 16-bit type; weights and optimizer stay in fp32."""
    s.say(f"\n== precision: {s.args.precision_steps} training steps each")
    # fp16's narrow exponent range lets small gradients underflow to zero, so the
    # loss is multiplied by a large scale before backward, gradients divided after.
    scaler = torch.amp.GradScaler(s.device.type)
    modes = [("fp32", None, None), ("bf16 autocast", torch.bfloat16, None),
             ("fp16 autocast + GradScaler", torch.float16, scaler)]
    for name, dtype, scaler in modes:
        ddp, optimizer = s.build_ddp(s.args.model)
        step = s.training_step(ddp, optimizer, dtype, scaler)
        losses, times = s.timed(step, s.args.precision_steps)
        step_ms = s.slowest_median(times[1:])
        s.record("precision", mode=name, losses=losses, step_ms=step_ms)
        s.say(f"{name:>28}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"{step_ms:.1f} ms per step")


def every_rank(flag: bool, device) -> list[bool]:
    """This flag from every rank, in rank order."""
    flags = torch.zeros(dist.get_world_size(), device=device)
    flags[dist.get_rank()] = float(flag)
    dist.all_reduce(flags)
    return [bool(f) for f in flags.tolist()]


def scaled_fp16_step(ddp, optimizer, scaler, x, y, loss_factor=1.0) -> dict:
    """One fp16 step with loss scaling, and what happened in it."""
    params = list(ddp.parameters())
    before = params[0].detach().clone()
    local_finite = []  # this rank's own gradients, before DDP averages them

    def check_local(param):
        local_finite.append(torch.isfinite(param.grad).all().item())

    hooks = [p.register_post_accumulate_grad_hook(check_local) for p in params]
    scale = scaler.get_scale()
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = ddp(x, y) * loss_factor
    scaler.scale(loss).backward()  # the gradients of loss x scale
    for hook in hooks:
        hook.remove()
    scaler.unscale_(optimizer)  # divides by the scale, notes any inf or NaN
    finite = all(torch.isfinite(p.grad).all().item() for p in params)
    scaler.step(optimizer)  # skipped if a gradient is not finite
    scaler.update()  # halves the scale after an overflow; doubles it after
    optimizer.zero_grad()  # growth_interval clean steps in a row
    return {"scale": scale, "next_scale": scaler.get_scale(),
            "local_finite": every_rank(all(local_finite), x.device),
            "finite": every_rank(finite, x.device),
            "stepped": every_rank(not torch.equal(before, params[0]), x.device)}


def clipped_step(s: Session, order: str, x, y, max_norm: float = 0.1) -> dict:
    """One fp16 step with clip_grad_norm_, with or without unscale_ before it."""
    torch.manual_seed(s.args.seed)
    model = GPT(MODEL_SIZES[s.args.model]).to(s.device)
    ddp = DDP(model, device_ids=ddp_device_ids(s.device))
    # SGD's update is proportional to the gradient, so the effect shows exactly.
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(s.device.type, init_scale=2.0**10)
    before = [p.detach().clone() for p in ddp.parameters()]
    with torch.autocast(s.device.type, dtype=torch.float16):
        loss = ddp(x, y)
    scaler.scale(loss).backward()
    if order == "unscale_ before clip":
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm).item()
    scaler.step(optimizer)  # unscales here if unscale_ was not called
    scaler.update()
    pairs = zip(ddp.parameters(), before, strict=True)
    update = torch.cat([(p.detach() - b).flatten() for p, b in pairs]).norm().item()
    s.say(f"{order:>22}: clip_grad_norm_ saw a norm of {norm:.4g}, "
          f"the update's norm is {update:.3g}")
    return {"scale": 2.0**10, "max_norm": max_norm, "norm_seen_by_clip": norm,
            "update_norm": update}


def grad_scaler_at_work(s: Session) -> None:
    """fp16 with a GradScaler, step by step, from a scale chosen too high."""
    s.say(f"\n== scaling: {s.args.scaling_steps} fp16 steps, GradScaler(init_scale="
          f"2**24, growth_interval={s.args.growth_interval})")
    ddp, optimizer = s.build_ddp(s.args.model)
    scaler = torch.amp.GradScaler(s.device.type, init_scale=2.0**24,
                                  growth_interval=s.args.growth_interval)
    for i in range(s.args.scaling_steps):
        x, y = s.batches[i % len(s.batches)]
        step = scaled_fp16_step(ddp, optimizer, scaler, x, y)
        s.record("scaling", step=i, growth_interval=s.args.growth_interval, **step)
        s.say(f"step {i:>2}: scale 2**{math.log2(step['scale']):g}, finite "
              f"{step['finite']}, stepped {step['stepped']} -> "
              f"2**{math.log2(step['next_scale']):g}")

    # A bad batch on rank 0 only: only rank 0's own gradients overflow.
    ddp, optimizer = s.build_ddp(s.args.model)
    scaler = torch.amp.GradScaler(s.device.type, init_scale=2.0**8)
    x, y = s.batches[0]
    for i, factor in enumerate([2.0**20 if s.rank == 0 else 1.0, 1.0]):
        step = scaled_fp16_step(ddp, optimizer, scaler, x, y, loss_factor=factor)
        s.record("one_rank_overflow", step=i, **step)
        s.say(f"bad batch on rank 0, step {i}: own gradients finite "
              f"{step['local_finite']}, after the all-reduce {step['finite']}, "
              f"stepped {step['stepped']}")
    weights = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    copies = [torch.empty_like(weights) for _ in range(s.world_size)]
    dist.all_gather(copies, weights)
    s.record("one_rank_overflow_replicas",
             identical=all(torch.equal(c, copies[0]) for c in copies))

    # Clipping needs the true gradient norm: unscale_ first, or clip sees the scale.
    for order in ("unscale_ before clip", "clip before unscale_"):
        s.record("clipping", order=order, **clipped_step(s, order, x, y))


def compare_options(s: Session) -> None:
    """gradient_as_bucket_view and static_graph change how DDP works, not results."""
    s.say("\n== DDP options: gradient memory, step time, weights after equal steps")
    configurations = {
        "default": {},
        "gradient_as_bucket_view=True": {"gradient_as_bucket_view": True},
        "static_graph=True": {"static_graph": True},
    }
    reference = None
    for name, options in configurations.items():
        log = BucketLog(default_hooks.allreduce_hook)
        ddp, optimizer = s.build_ddp(s.args.model, **options)
        ddp.register_comm_hook(log, logged_hook)
        step = s.training_step(ddp, optimizer)
        times = s.step_times_ms(step, s.args.steps)
        step_ms = statistics.median(times)

        # One more backward, then ask of every gradient: is its memory in a bucket?
        log.calls.clear()
        x, y = s.batches[0]
        ddp(x, y).backward()
        buffers = [(ptr, nbytes) for ptr, nbytes, _ in log.calls]
        params = list(ddp.parameters())
        inside = [any(start <= p.grad.data_ptr() < start + size
                      for start, size in buffers) for p in params]
        grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
        separate_bytes = sum(p.grad.numel() * p.grad.element_size()
                             for p, shared in zip(params, inside, strict=True)
                             if not shared)
        bucket_bytes = sum(nbytes for _, nbytes in buffers)
        optimizer.zero_grad()

        weights = [p.detach().clone() for p in params]
        reference = reference or weights
        difference = max_difference(reference, weights)
        memory = bucket_bytes + separate_bytes
        s.record("options", config=name, step_ms=step_ms, step_ms_all=times,
                 grads_in_buckets=sum(inside), params=len(inside),
                 grad_bytes=grad_bytes, bucket_bytes=bucket_bytes,
                 gradient_memory_bytes=memory, max_weight_difference=difference)
        s.say(f"{name:>30}: {sum(inside)}/{len(inside)} grads inside a bucket, "
              f"gradient memory {memory / 2**20:.2f} MiB, {step_ms:.1f} ms/step, "
              f"weights differ from default by {difference:.1e}")


class NormedMLP(nn.Module):
    """A model with buffers: BatchNorm keeps running statistics of its inputs."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x))))


def compare_buffer_sync(s: Session, steps: int = 3) -> None:
    """DDP cannot average buffers: it copies rank 0's at each forward, or not."""
    s.say("\n== buffers: BatchNorm running_mean at the start of each forward, "
          "compared across ranks")
    gpt_buffers = len(list(GPT(MODEL_SIZES[s.args.model]).buffers()))
    for sync in (True, False):
        torch.manual_seed(s.args.seed)
        net = NormedMLP().to(s.device)
        device_ids = ddp_device_ids(s.device)
        # forward_sync_buffers: torch 2.13's name for what was broadcast_buffers.
        ddp = DDP(net, device_ids=device_ids, forward_sync_buffers=sync)
        seen = []

        def note(module, inputs, seen=seen):
            seen.append(module.running_mean.clone())

        net.norm.register_forward_pre_hook(note)
        data = torch.Generator().manual_seed(s.args.seed + s.rank)
        for _ in range(steps):  # every rank sees different data
            x = (torch.randn(32, 8, generator=data) + s.rank).to(s.device)
            ddp(x).sum().backward()
        seen.append(net.norm.running_mean.clone())
        everyone = [torch.empty_like(torch.stack(seen)) for _ in range(s.world_size)]
        dist.all_gather(everyone, torch.stack(seen))
        equal = [all(torch.equal(other[i], everyone[0][i]) for other in everyone)
                 for i in range(len(seen))]
        s.record("buffers", forward_sync_buffers=sync,
                 equal_at_forward_start=equal[:-1],
                 equal_after_last_forward=equal[-1], gpt_buffers=gpt_buffers)
        s.say(f"forward_sync_buffers={sync!s:>5}: same on all ranks at the start of "
              f"forward 1..{steps}: {equal[:-1]}; after the last: {equal[-1]}")
    s.say(f"the {s.args.model} GPT has {gpt_buffers} buffers, so for ch3_train.py "
          "this flag changes nothing")


def powersgd_state() -> powerSGD_hook.PowerSGDState:
    """PowerSGD at rank 1: each gradient matrix travels as two vectors, P and Q."""
    # Plain all-reduces for the first 2 iterations, as PowerSGD requires with
    # error feedback; compressed from then on.
    return powerSGD_hook.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=1,
                                       start_powerSGD_iter=2)


def elements_sent(state) -> int | None:
    """PowerSGD's own count of the elements it has all-reduced so far (P, Q, the rest)."""
    return None if state is None else state.compression_stats()[2]


def compare_compression(s: Session) -> None:
    """A hook shrinks what each bucket all-reduces: a 16-bit cast, or PowerSGD."""
    s.say("\n== compression hooks: bytes handed to dist.all_reduce per step, error")
    hooks = {  # name: (hook or None for DDP's built-in reduction, hook state)
        "allreduce_hook (fp32)": (default_hooks.allreduce_hook, None),
        "fp16_compress_hook": (default_hooks.fp16_compress_hook, None),
        "bf16_compress_hook": (default_hooks.bf16_compress_hook, None),
        "powerSGD_hook (rank 1)": (powerSGD_hook.powerSGD_hook, powersgd_state()),
        "built-in (no hook)": (None, None),  # what the fp32 hook must reproduce
    }
    reference = reference_weights = None
    # The first hook's bucket count; every hook gets the same layout.
    fp32_buckets = 0
    for name, (hook, state) in hooks.items():
        if state is not None and s.backend == "gloo" and fp32_buckets > 1:
            # PowerSGD all-reduces P and Q from the callbacks of earlier
            # all-reduces, which gloo runs on its threads as each completes:
            # with several buckets, two buckets' all-reduces can start in a
            # different order on each rank, and gloo reports a collective
            # mismatch or hangs (tests/ch3/test_compression.py).
            reason = (f"not run: {fp32_buckets} buckets on gloo, where "
                      "PowerSGD starts all-reduces in completion order, "
                      "which differs between ranks")
            s.record("compression", hook=name, skipped=reason)
            s.say(f"{name:>22}: {reason}")
            continue
        log = BucketLog(hook, state)
        ddp, optimizer = s.build_ddp(s.args.model)
        if hook is not None:
            ddp.register_comm_hook(log, logged_hook)
        x, y = s.batches[0]
        ddp(x, y).backward()  # settles the bucket layout
        while state is not None and state.iter < state.start_powerSGD_iter:
            ddp(x, y).backward()  # PowerSGD's plain iterations
        optimizer.zero_grad()
        log.calls.clear()
        sent_before = elements_sent(state)
        # PowerSGD: its first compressed step, from a random Q
        with AllReduceLog() as sent:
            ddp(x, y).backward()
        # What this one backward handed over, before training adds to the logs.
        buckets = [elements for _, _, elements in log.calls]
        counted = None if state is None else elements_sent(state) - sent_before
        grads = torch.cat([g.flatten() for g in grads_of(ddp)])
        optimizer.zero_grad()
        if state is not None:
            # This backward's residual would be added to the first training step's
            # gradient: dropped, so that every hook trains on the same batches'
            # gradients only.
            state.error_dict.clear()
        reference = grads if reference is None else reference
        error = grads - reference
        relative_error = (error.norm() / reference.norm()).item()
        step_ms = s.median_step_ms(s.training_step(ddp, optimizer), s.args.steps)
        # Every hook took the same optimizer steps on the same batches from the same
        # weights: the gap to fp32's weights is what the compression changed.
        weights = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
        reference_weights = reference_weights or weights
        # DDP's built-in reduction all-reduces from C++, past
        # dist.all_reduce: not counted.
        wire_bytes = sum(nbytes for _, nbytes, _ in sent.tensors) if hook else None
        s.record("compression", hook=name, bytes_per_step=wire_bytes,
                 all_reduced=sent.tensors, bucket_elements=buckets,
                 torch_counted_elements=counted, buckets=len(buckets),
                 max_abs_error=error.abs().max().item(),
                 relative_error=relative_error,
                 max_abs_grad=reference.abs().max().item(), step_ms=step_ms,
                 optimizer_steps=WARMUP_STEPS + s.args.steps,
                 weights_gap=training_gap(weights, reference_weights))
        sent_text = ("not seen: DDP's C++ reducer" if wire_bytes is None else
                     f"{wire_bytes / 2**20:.3f} MiB in "
                     f"{len(sent.tensors)} all-reduce(s) "
                     f"for {len(buckets)} bucket(s)")
        s.say(f"{name:>22}: {sent_text}, relative error {relative_error:.2e}, "
              f"{step_ms:.1f} ms/step")
        fp32_buckets = fp32_buckets or len(buckets)


def main() -> None:
    args = parse_args()
    backend, device = start_process_group(args.backend)
    session = Session(args, backend, device)
    session.record("config", model=args.model, sweep_model=args.sweep_model, batch_size=args.batch_size,
                   context=MODEL_SIZES[args.model].context, optimizer="AdamW", lr=DEFAULTS.lr,
                   bucket_cap_mb=args.bucket_cap_mb)
    session.say(f"{session.world_size} process(es), {args.model} model, batch {args.batch_size} per process")

    run = {"buckets": sweep_buckets, "accumulation": compare_accumulation,
           "precision": compare_precision, "scaling": grad_scaler_at_work,
           "options": compare_options, "buffers": compare_buffer_sync,
           "compression": compare_compression}
    for name in EXPERIMENTS:
        if name in args.experiments:
            run[name](session)
    session.metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
