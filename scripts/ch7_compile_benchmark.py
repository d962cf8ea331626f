"""Eager against torch.compile on the book's GPT: compile seconds, step times, the same losses.

    python scripts/ch7_compile_benchmark.py                              # one process
    torchrun --standalone --nproc_per_node=2 scripts/ch7_compile_benchmark.py   # DDP
    python scripts/ch7_compile_benchmark.py --model tiny --compiler aot_eager

Two copies of the model start from the same weights and train on the same batches: one
eager, one compiled with torch.compile. Under torchrun both are wrapped in DDP (chapter 3's
scripts/ch3_compile_ddp.py shows how the compiler splits a DDP model at bucket boundaries).
The first step of each is timed on its own: for the compiled copy it includes tracing the
model and compiling it, which inductor does by generating C++ (Triton on a GPU) and calling
the compiler. Then --steps steady steps of the two take turns (dtbook.timing), each timed as
the slowest rank saw it, and every step's loss is recorded for comparison.

Inductor caches what it compiled on disk, in TORCHINDUCTOR_CACHE_DIR: a second run on the
same graphs skips the C++ compiler. --cache-dir chooses that directory; the script records
whether it was empty, so a compile time is always reported with the state of its cache.
"""

import argparse
import logging
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.data import DEFAULTS, corpus_windows, first_batches
from dtbook.distributed import (
    ddp_device_ids,
    drain_gloo_workers,
    open_metrics,
    require_gpu_for,
    start_process_group,
)
from dtbook.model import GPT, MODEL_SIZES
from dtbook.timing import time_in_turns


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_SIZES), default="small", help="model size (default: small)")
    add("--batch-size", type=positive_int, default=8, help="windows per process per step")
    add("--steps", type=positive_int, default=20, help="steady steps timed per copy (default 20)")
    add("--warmup", type=int, default=2, help="untimed steps after the first (default 2)")
    add("--compiler", choices=["auto", "inductor", "aot_eager"], default="auto",
        help="torch.compile backend (default: inductor if a C++ compiler is found)")
    add("--cache-dir", type=Path, help="inductor's on-disk cache (default: its own, under /tmp)")
    add("--lr", type=float, default=DEFAULTS.lr)
    add("--seed", type=int, default=DEFAULTS.seed)
    add_backend_and_metrics(parser)
    args = parser.parse_args()
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    has_compiler = any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))
    if args.compiler == "auto":
        args.compiler = "inductor" if has_compiler or torch.cuda.is_available() else "aot_eager"
    elif args.compiler == "inductor" and not (has_compiler or torch.cuda.is_available()):
        raise ScriptError("--compiler inductor needs a C++ compiler (g++ or clang++) on the PATH "
                          "on a CPU; install one or use --compiler aot_eager")
    return args


# DDP's forward runs under a profiler label, which the compiler leaves out of its graph and
# warns about once per rank: expected here, so not shown.
logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(
    lambda record: "Profiler record function" not in record.getMessage())


def use_cache(directory: Path | None) -> tuple[str, bool]:
    """Point inductor at its cache before anything compiles.

    Returns the cache's directory and whether it was empty.
    """
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory.resolve())
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    where = Path(cache_dir())
    return str(where), not (where.exists() and any(where.iterdir()))


def build(cfg, device, seed: int, lr: float, distributed: bool):
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    if distributed:
        model = DDP(model, device_ids=ddp_device_ids(device))
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def trainer(model, optimizer, batches, losses: list[float]):
    """One training step per call, on the next batch; its loss goes to ``losses``."""
    remaining = iter(batches)

    def step() -> None:
        x, y = next(remaining)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    return step


def slowest_seconds(fn, device) -> float:
    """Wall time of one collective call of ``fn``, as the slowest rank saw it."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor(time.perf_counter() - start, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def main() -> None:
    args = parse_args()
    cache, cache_was_empty = use_cache(args.cache_dir)
    backend, device = start_process_group(args.backend)
    require_gpu_for(args.model, device)
    # Inductor suggests TF32 on every compile on a recent GPU. fp32 means fp32 in this
    # comparison of eager and compiled; TF32 is its own row in the GPU results.
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = open_metrics(args.metrics, backend, device)
    cfg = MODEL_SIZES[args.model]
    count = 1 + args.warmup + args.steps
    dataset = corpus_windows(count * world_size * args.batch_size * cfg.context + 1, cfg.vocab_size,
                             cfg.context, args.seed)
    batches = first_batches(dataset, args.batch_size, rank, world_size, args.seed, count, device)
    distributed = world_size > 1

    losses = {"eager": [], "compiled": []}
    eager, eager_optimizer = build(cfg, device, args.seed, args.lr, distributed)
    compiled, compiled_optimizer = build(cfg, device, args.seed, args.lr, distributed)
    compiled = torch.compile(compiled, backend=args.compiler)
    steps = {"eager": trainer(eager, eager_optimizer, batches, losses["eager"]),
             "compiled": trainer(compiled, compiled_optimizer, batches, losses["compiled"])}

    first_step_s = {name: slowest_seconds(step, device) for name, step in steps.items()}
    step_ms = time_in_turns(steps, args.steps, args.warmup, device)
    counters = torch._dynamo.utils.counters
    metrics.write(event="setup", model=args.model, params=sum(p.numel() for p in eager.parameters()),
                  compiler=args.compiler, ddp=distributed, world_size=world_size,
                  tokens_per_step=world_size * args.batch_size * cfg.context,
                  cache_dir=cache, cache_was_empty=cache_was_empty,
                  cache_counters={f"{group}.{key}": value for group in ("inductor", "aot_autograd")
                                  for key, value in counters[group].items() if "cache" in key})
    for name in steps:
        metrics.write(event="variant", variant=name, first_step_s=first_step_s[name],
                      step_ms=step_ms[name], losses=losses[name])
        if rank == 0:
            ms = sorted(step_ms[name])
            print(f"{name:<9} first step {first_step_s[name]:7.2f} s   steady steps: median "
                  f"{ms[len(ms) // 2]:7.2f} ms (min {ms[0]:.2f}, max {ms[-1]:.2f})   "
                  f"last loss {losses[name][-1]:.4f}")
    metrics.close()
    drain_gloo_workers()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
