"""Profile one DDP training step and save a trace you can open in Perfetto (ui.perfetto.dev) or chrome://tracing.

    torchrun --standalone --nproc_per_node=2 scripts/ch3_profile_step.py
    torchrun --standalone --nproc_per_node=2 scripts/ch3_profile_step.py --model medium --bucket-cap-mb 1

The step is ch3_train.py's (same model, batch and optimizer), cut into record_function regions
"forward", "backward" and "optimizer". Every rank writes its own trace, <trace-dir>/rank<R>.json.
In it, DDP launches each bucket's all-reduce from the backward pass ("c10d::allreduce_" on the
main thread) and the backend runs it on its own threads ("gloo:all_reduce" or "nccl:all_reduce").
Rank 0 reads its trace back and writes the intervals to --metrics, for the chapter's timeline plot.

The default bucket cap is 0.1 MiB, not DDP's 25 MiB: the small model's gradients (under 0.5 MiB) would
otherwise fill a single bucket, whose all-reduce cannot start before the last gradient is ready.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_float, positive_int, run_main, script_parser
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import ddp_device_ids, drain_gloo_workers, open_metrics, start_process_group
from dtbook.intervals import busy_ms, overlap_ms, read_intervals
from dtbook.model import GPT, MODEL_SIZES
from dtbook.paths import RUNS_DIR

REGIONS = ("forward", "backward", "optimizer")


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="small", help="model size (default: small)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="samples per process (default 16)")
    parser.add_argument("--bucket-cap-mb", type=positive_float, default=0.1,
                        help="DDP bucket size in MiB (default 0.1, so that there are several buckets to overlap)")
    parser.add_argument("--warmup", type=positive_int, default=3,
                        help="unprofiled steps first, at least 2: DDP lays out its buckets anew in step 2 (default 3)")
    parser.add_argument("--trace-dir", type=Path, default=RUNS_DIR / "ch3_profile_step",
                        help="where every rank writes rank<R>.json (default: runs/ch3_profile_step)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    add_backend_and_metrics(parser)
    args = parser.parse_args()
    if args.warmup < 2:
        raise ScriptError(f"--warmup must be at least 2: step 1 runs with DDP's provisional buckets, got {args.warmup}")
    return args


def is_collective(name: str) -> bool:
    """The backend's own record of an all-reduce (gloo:all_reduce, nccl:all_reduce, NCCL kernels).

    It lasts from when the backend picks the bucket up until the result is there, which includes
    waiting for the other ranks to hand over the same bucket.
    """
    name = name.lower()
    return not name.startswith("c10d::") and ("all_reduce" in name or "allreduce" in name)


def interval_kind(name: str) -> str | None:
    """What the timeline calls a trace event, or None for the events it leaves out."""
    if name in REGIONS:
        return name
    if name == "c10d::allreduce_":
        return "all-reduce launched"
    if is_collective(name):
        return "all-reduce in progress"
    if name.startswith("autograd::engine::evaluate_function"):
        return "gradient computation"
    return None


def summarize(intervals: list[dict], trace_path: Path, per_bucket: list[int]) -> dict:
    """What the timeline shows, in numbers: launches, runs and their overlap."""
    def of(kind):
        return [i for i in intervals if i["kind"] == kind]

    in_progress, computing = of("all-reduce in progress"), of("gradient computation")
    return {
        "trace": str(trace_path.resolve()),
        "buckets": len(per_bucket),
        "params": sum(per_bucket),
        "params_per_bucket": per_bucket,
        "all_reduce_launches": len(of("all-reduce launched")),
        "all_reduce_runs": len(in_progress),
        "first_launch_ms": min(i["start_ms"] for i in of("all-reduce launched")),
        "gradients_done_ms": max(i["end_ms"] for i in computing),
        "all_reduce_ms": busy_ms(in_progress),
        "all_reduce_during_gradient_computation_ms": overlap_ms(in_progress, computing),
    }


def main() -> None:
    args = parse_args()
    try:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ScriptError(f"cannot create --trace-dir {args.trace_dir}: "
                          f"{err.strerror}") from None
    backend, device = start_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    cfg = MODEL_SIZES[args.model]
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    ddp = DDP(model, device_ids=ddp_device_ids(device),
              bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=DEFAULTS.lr)

    data = corpus_windows(DEFAULTS.corpus_tokens, cfg.vocab_size, cfg.context,
                          args.seed)
    batches = first_batches(data, args.batch_size, rank, world_size, args.seed,
                            args.warmup + 1, device)
    for x, y in batches[:-1]:
        ddp(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    x, y = batches[-1]
    dist.barrier()
    with profile(activities=activities) as prof:
        with record_function("forward"):
            loss = ddp(x, y)
        with record_function("backward"):
            loss.backward()  # returns once DDP has waited for every bucket
        with record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    trace_path = args.trace_dir / f"rank{rank}.json"
    prof.export_chrome_trace(str(trace_path))

    layout = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    per_bucket = [len(bucket.split()) for bucket in layout.split(",")]
    if rank == 0:
        intervals = read_intervals(trace_path, interval_kind)
        summary = summarize(intervals, trace_path, per_bucket)
        metrics = open_metrics(args.metrics, backend, device)
        for interval in intervals:
            metrics.write(event="interval", **interval)
        metrics.write(event="summary", **summary)
        metrics.close()
        print(f"trace of one step (rank 0): {summary['trace']}")
        print(f"{summary['buckets']} buckets; {summary['all_reduce_launches']} "
              f"all-reduces launched, the first at "
              f"{summary['first_launch_ms']:.1f} ms; the last gradient was "
              f"computed at {summary['gradients_done_ms']:.1f} ms")
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
