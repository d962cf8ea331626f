"""Profile one FSDP2 training step: each unit's all-gather and reduce-scatter, in a trace.

    torchrun --standalone --nproc_per_node=2 scripts/ch7_profile_fsdp.py
    torchrun --standalone --nproc_per_node=2 scripts/ch7_profile_fsdp.py --model tiny

The model is ch3_train.py's, sharded as ch4_fsdp.py shards it by default: fully_shard on each
transformer block, then on the root (embeddings, final norm and head). The step is cut into
record_function regions "forward", "backward" and "optimizer". FSDP gathers a unit's
parameters before its forward and again before its backward (the root keeps its own through
the step), and reduce-scatters each unit's gradients after its backward. The trace shows
each launch (c10d::_allgather_base_, c10d::_reduce_scatter_base_) and the backend's work
(gloo:all_gather; gloo carries a reduce-scatter out as an all-reduce, gloo:all_reduce,
and keeps the rank's shard; on GPUs nccl:all_gather and nccl:reduce_scatter and kernels).
Every rank writes <trace-dir>/rank<R>.json; rank 0 writes the intervals and a summary to
--metrics.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile, record_function

from dtbook.cli import (
    ScriptError,
    add_backend_and_metrics,
    positive_int,
    run_main,
    script_parser,
)
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import drain_gloo_workers, open_metrics, start_process_group
from dtbook.intervals import busy_ms, overlap_ms, read_intervals
from dtbook.model import GPT, MODEL_SIZES
from dtbook.paths import RUNS_DIR

REGIONS = ("forward", "backward", "optimizer")
LAUNCHES = {"c10d::_allgather_base_": "all-gather launched",
            "c10d::allgather_into_tensor_coalesced_": "all-gather launched",
            "c10d::_reduce_scatter_base_": "reduce-scatter launched",
            "c10d::reduce_scatter_tensor_coalesced_": "reduce-scatter launched"}


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="medium",
                        help="model size (default: medium)")
    parser.add_argument("--batch-size", type=positive_int, default=2,
                        help="samples per process (default 2)")
    parser.add_argument("--warmup", type=positive_int, default=2,
                        help="unprofiled steps first (default 2): FSDP sets itself up in "
                             "the first")
    parser.add_argument("--trace-dir", type=Path, default=RUNS_DIR / "ch7_profile_fsdp",
                        help="where every rank writes rank<R>.json")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data")
    add_backend_and_metrics(parser)
    return parser.parse_args()


def interval_kind(name: str) -> str | None:
    """What the timeline calls a trace event, or None for events it leaves out."""
    if name in REGIONS:
        return name
    if name in LAUNCHES:
        return LAUNCHES[name]
    lower = name.lower()
    if lower.startswith(("gloo:", "nccl:", "nccldevkernel", "ncclkernel")):
        if "gather" in lower:
            return "all-gather in progress"
        # gloo runs FSDP's reduce-scatter as an all-reduce, the step's only one
        return "reduce-scatter in progress"
    if name.startswith("autograd::engine::evaluate_function"):
        return "gradient computation"
    return None


def summarize(intervals: list[dict], trace_path: Path, units: int) -> dict:
    """Collectives per region and how much of their time backward's computation hid."""
    def of(kind):
        return [i for i in intervals if i["kind"] == kind]

    (backward,) = of("backward")

    def in_backward(i) -> bool:
        return backward["start_ms"] <= i["start_ms"] <= backward["end_ms"]

    gathers = of("all-gather launched")
    communication = of("all-gather in progress") + of("reduce-scatter in progress")
    return {"trace": str(trace_path.resolve()), "units": units,
            "all_gathers_in_forward": sum(not in_backward(i) for i in gathers),
            "all_gathers_in_backward": sum(in_backward(i) for i in gathers),
            "reduce_scatters": len(of("reduce-scatter launched")),
            "communication_ms": busy_ms(communication),
            "communication_during_gradient_computation_ms":
                overlap_ms(communication, of("gradient computation"))}


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
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)  # the root: embeddings, final norm, head
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEFAULTS.lr)

    data = corpus_windows(DEFAULTS.corpus_tokens, cfg.vocab_size, cfg.context,
                          args.seed)
    batches = first_batches(data, args.batch_size, rank, world_size, args.seed,
                            args.warmup + 1, device)
    for x, y in batches[:-1]:
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    x, y = batches[-1]
    dist.barrier()
    with profile(activities=activities) as prof:
        with record_function("forward"):
            loss = model(x, y)
        with record_function("backward"):
            loss.backward()  # returns once FSDP has reduce-scattered every unit
        with record_function("optimizer"):
            optimizer.step()  # on this rank's shards only
            optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    trace_path = args.trace_dir / f"rank{rank}.json"
    prof.export_chrome_trace(str(trace_path))

    if rank == 0:
        intervals = read_intervals(trace_path, interval_kind)
        summary = summarize(intervals, trace_path, units=len(model.blocks) + 1)
        metrics = open_metrics(args.metrics, backend, device)
        for interval in intervals:
            metrics.write(event="interval", **interval)
        metrics.write(event="summary", **summary)
        metrics.close()
        print(f"trace of one step (rank 0): {summary['trace']}")
        print(f"{summary['units']} FSDP units; all-gathers: "
              f"{summary['all_gathers_in_forward']} in forward, "
              f"{summary['all_gathers_in_backward']} in backward; "
              f"{summary['reduce_scatters']} reduce-scatters")
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
