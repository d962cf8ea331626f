"""Every GPU result of the book in one command, within a fixed time budget.

    python scripts/gpu_results.py                      # on a CUDA machine: measure, then render
    python scripts/gpu_results.py --out runs/gpu_results/mine --budget-s 450
    python scripts/gpu_results.py --render notebooks/appendix/gpu_measurements/h100_2026-11-26

On one GPU it runs, one after the other, each with its own time cap:

  precision    the book's GPT at its large size and at GPT-2 small's shape (--model gpt2-small),
               one AdamW step in fp32, TF32, bf16 autocast and bf16 + torch.compile: ms/step,
               tokens/s, MFU and peak memory (in this process)
  ch1_*        ch1_memory.py with the allocator snapshot, ch1_attention.py (SDPA's kernels),
               ch1_precision.py
  ch3_*, ch4_* ch3_train.py --amp bf16 and fp16, ch4_fsdp.py --mixed-precision bf16,
               ch4_footprint.py with fsdp2_offload (device and host memory apart)
  ch7_compile  ch7_compile_benchmark.py at gpt2-small; ch6_lightning: the Trainer on one GPU

With 2 or more GPUs it also runs, on all of them: ch2_bandwidth.py (NCCL bus bandwidth and the
alpha-beta fit), ch3_overlap_benchmark.py and ch4_fsdp.py at gpt2-small.

Then every companion script (scripts/ch*.py) once, on one process with --backend nccl and small
arguments (every_script_runs), up to --jobs at a time: whether its CUDA path runs at all. A script
that refuses a world of one is listed as skipped, with the reason. A run that would start after
its budget (--budget-s for the measurements, then --scripts-budget-s for this stage) is skipped
and recorded as skipped; one past its cap is killed.

The folder it writes holds each run's --metrics file, runs.jsonl (every command, its exit status
and seconds), every_script/ (the stage's metrics files and console logs), provenance.json (GPU,
driver, torch, date, commit) and tables.md, rendered by dtbook.gpu_report exactly as the appendix
renders it. To publish a folder, copy it to notebooks/appendix/gpu_measurements/ and name it in
the appendix's MEASUREMENTS.
Without CUDA it says so and exits 2; --render needs no GPU.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dtbook import gpu_report
from dtbook.cli import ScriptError, positive_int, run_main, script_parser
from dtbook.metrics import MetricsWriter
from dtbook.model import GPT, MODEL_SIZES
from dtbook.paths import REPO_ROOT, SCRIPTS_DIR

# Dense bf16 tensor-core peaks from the datasheets, matched in order against the GPU's name.
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12),
                   ("B200", 2250e12), ("A100", 312e12)]
# (model size, batch): the book's large GPT, and GPT-2 small's shape.
PRECISION_RUNS = [("large", 64), ("gpt2-small", 16)]
# A script's one-line error ("error: ...", "[rank 0] error: ...") or an exception's last line.
ERROR_LINE = re.compile(r"(^|\] )error: |\b\w*(Error|Exception): ")


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--out", type=Path, help="the folder to write (default: runs/gpu_results/<date>_<gpu>)")
    add("--budget-s", type=positive_int, default=450,
        help="seconds for the measurements (default 450)")
    add("--scripts-budget-s", type=positive_int, default=240,
        help="seconds, after them, for running every companion script once (default 240)")
    add("--render", type=Path, metavar="FOLDER", help="only render FOLDER's tables (no GPU needed)")
    add("--jobs", type=positive_int, default=4,
        help="companion scripts at a time on the GPU in the every-script stage (default 4)")
    return parser.parse_args()


def one_gpu_runs(out: Path, gpus: int) -> list[tuple[str, list, int, int]]:
    """(name, script and arguments, processes, cap in seconds) on one GPU."""
    nccl = ["--backend", "nccl"]
    return [
        ("ch1_memory", ["ch1_memory.py", "--models", "small", "medium",
                        "--snapshot", out / "ch1_snapshot.pickle"], 0, 60),
        ("ch1_attention", ["ch1_attention.py"], 0, 60),
        ("ch1_precision", ["ch1_precision.py", "--model", "medium"], 0, 60),
        ("ch3_bf16", ["ch3_train.py", *nccl, "--amp", "bf16", "--max-steps", 40], 1, 60),
        ("ch3_fp16", ["ch3_train.py", *nccl, "--amp", "fp16", "--max-steps", 40], 1, 60),
        ("ch4_fsdp", ["ch4_fsdp.py", *nccl, "--mixed-precision", "bf16", "--max-steps", 30], 1, 60),
        ("ch4_footprint", ["ch4_footprint.py", *nccl, "--configs", "ddp", "zero1", "fsdp2_full",
                           "fsdp2_full_ac", "fsdp2_offload"], gpus, 90),
        ("ch7_compile", ["ch7_compile_benchmark.py", "--model", "gpt2-small",
                         "--compiler", "inductor"], 0, 120),
        ("ch6_lightning", ["ch6_lightning.py", "--max-steps", 20], 1, 60),
    ]


def several_gpu_runs(gpus: int) -> list[tuple[str, list, int, int]]:
    nccl = ["--backend", "nccl"]
    return [
        ("ch2_bandwidth", ["ch2_bandwidth.py", *nccl, "--max-bytes", "256MiB", "--step", 16,
                           "--size-seconds", 0.5], gpus, 120),
        ("ch3_overlap", ["ch3_overlap_benchmark.py", *nccl, "--model", "gpt2-small",
                         "--batch-size", 4, "--bucket-cap-mb", "default", 25, 100], gpus, 150),
        ("ch4_fsdp_multi", ["ch4_fsdp.py", *nccl, "--model", "gpt2-small", "--batch-size", 4,
                            "--corpus-tokens", 2_000_000, "--mixed-precision", "bf16",
                            "--max-steps", 20], gpus, 120),
    ]


def command(script_and_args: list, processes: int, metrics: Path) -> list[str]:
    """python for a world of one (processes 0), torchrun for processes >= 1."""
    script, *args = map(str, script_and_args)
    launcher = [sys.executable]
    if processes:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    return [*launcher, str(SCRIPTS_DIR / script), *args, "--metrics", str(metrics)]


def run_capped(argv: list[str], cap_s: float, log: Path, env: dict | None = None) -> tuple[int | str, float]:
    """Run ``argv`` with its output in ``log``; kill its whole process group past ``cap_s``.

    ``env``: variables added to this process's environment for the run.
    """
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env={**os.environ, **env} if env else None, start_new_session=True)
        try:
            status = proc.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"killed after {cap_s} s"
    return status, time.monotonic() - start


# ---------------------------------------------------------------- every companion script


@dataclass
class ScriptRun:
    """How the every-script stage runs one companion script on one GPU, or why it does not."""

    script: str
    args: tuple = ()
    processes: int = 0  # 0: python, a world of one; 1: torchrun --nproc_per_node=1
    cap_s: int = 60
    env: dict = field(default_factory=dict)  # added to the run's environment
    skip: str = ""  # why it does not run on one process: then it is not run
    note: str = ""  # what else the table says about the run

    def how(self) -> str:
        if self.skip:
            return "not run"
        how = "python (a world of one)" if self.processes == 0 else "torchrun --nproc_per_node=1"
        return f"{how}; {self.note}" if self.note else how


def every_script_runs(scratch: Path) -> list[ScriptRun]:
    """Every scripts/ch*.py, with arguments small enough for seconds; its files go to ``scratch``.

    tests/lib/test_gpu_report.py checks that the list names every companion script, that each
    script takes its arguments (with --backend nccl) as far as starting its process group, and
    that each one skipped for its world size refuses a world of one.
    """
    tiny, corpus = ("--model", "tiny"), ("--corpus-tokens", 20_000)
    lab = "the book runs it across the cluster lab's nodes; here one process, no lab"
    return [
        ScriptRun("ch1_accumulation.py", (*tiny, "--train-steps", 2)),
        ScriptRun("ch1_attention.py", (*tiny, "--seq-lens", 64, 128, "--repeats", 1)),
        ScriptRun("ch1_checkpointing.py", (*tiny, "--batch-size", 4, "--repeats", 1)),
        ScriptRun("ch1_memory.py", ("--models", "tiny", "--sweep-model", "tiny", "--batch-sizes", 1, 2,
                                    "--seq-lens", 16, 32, "--snapshot", scratch / "ch1_snapshot.pickle")),
        ScriptRun("ch1_precision.py", (*tiny, "--batch-size", 4, "--steps", 6, "--scaler-steps", 6,
                                       "--inject-inf-at", 3, "--tokens-per-batch", 4096)),
        ScriptRun("ch2_bandwidth.py", ("--max-bytes", "64KiB", "--step", 16, "--rounds", 3,
                                       "--size-seconds", 0.2,
                                       "--model-out", scratch / "ch2_alpha_beta.json")),
        ScriptRun("ch2_collectives.py", skip="needs 2 or more processes: collectives need company"),
        ScriptRun("ch2_hello_distributed.py"),
        ScriptRun("ch2_process_groups.py", skip="needs 2 or more processes: it splits the world into groups"),
        ScriptRun("ch2_ring_all_reduce.py", ("--check-elements", 1, 4099, "--sizes", 64, "4KiB",
                                             "--rounds", 3)),
        ScriptRun("ch3_compile_ddp.py", ("--layers", 2, "--steps", 2), cap_s=150),
        ScriptRun("ch3_ddp_knobs.py", (*tiny, "--sweep-model", "tiny", "--bucket-caps", 0.1, 1,
                                       "--batch-size", 4, "--steps", 2, "--precision-steps", 3,
                                       "--scaling-steps", 4)),
        ScriptRun("ch3_evaluate.py", ("--train-steps", 2)),
        ScriptRun("ch3_failures.py", ("--failure", "unused-parameter", "--both-fixes", "--steps", 2),
                  note="--failure unused-parameter with both fixes, which ends well"),
        ScriptRun("ch3_find_unused_cost.py", ("--steps", 3, "--warmup", 1)),
        ScriptRun("ch3_hang_forensics.py", ("--steps", 2, "--dump-at-end"),
                  env={"TORCH_FR_BUFFER_SIZE": "2000",
                       "TORCH_FR_DUMP_TEMP_FILE": str(scratch / "ch3_flight_record_rank")},
                  note="no hang (--extra-on-rank needs 2 processes): the flight recorder's dump at the end"),
        ScriptRun("ch3_minimal_ddp.py", (*tiny, "--steps", 2)),
        ScriptRun("ch3_overlap_benchmark.py", (*tiny, "--batch-size", 4, "--steps", 2, "--repeats", 1,
                                               "--warmup", 1)),
        ScriptRun("ch3_profile_step.py", (*tiny, "--batch-size", 4, "--warmup", 2,
                                          "--trace-dir", scratch / "ch3_profile_step")),
        ScriptRun("ch3_repeatability.py", ("--runs", 2, "--nproc", 1, "--model", "tiny", "--max-steps", 3),
                  cap_s=90, note="it launches ch3_train.py twice itself, torchrun --nproc_per_node=1"),
        ScriptRun("ch3_sampler.py", ("--steps", 2)),
        ScriptRun("ch3_spawn.py", ("--nproc", 1), note="it starts its one worker itself (mp.spawn)"),
        ScriptRun("ch3_torchrun_env.py", processes=1, note="its lesson is torchrun's variables"),
        ScriptRun("ch3_train.py", (*tiny, *corpus, "--max-steps", 3)),
        ScriptRun("ch4_footprint.py", (*tiny, "--batch-size", 4)),
        ScriptRun("ch4_fsdp.py", (*tiny, *corpus, "--max-steps", 3)),
        ScriptRun("ch4_knobs.py", ("--knobs", "mixed_precision", "shard_placement", "offload_cost",
                                   "--steps", 5),
                  note="one process: the int reshard needs a world with a proper divisor; "
                       "the offload cost is real here"),
        ScriptRun("ch4_minimal_fsdp.py", (*tiny, "--batch-size", 4, "--steps", 2)),
        ScriptRun("ch4_pitfalls.py", ("--timeout-s", 10)),
        ScriptRun("ch4_zero1.py", (*tiny, "--batch-size", 4, "--steps", 2)),
        ScriptRun("ch5_cluster_check.py", ("--timeout", 30), note=lab),
        ScriptRun("ch5_link_benchmark.py", (*tiny, "--steps", 2, "--warmup", 1, "--sizes-mib", 0.25,
                                            "--bucket-caps", 0.25, 1), note=lab),
        ScriptRun("ch6_fabric.py", (*tiny, *corpus, "--max-steps", 3)),
        ScriptRun("ch6_lightning.py", (*tiny, *corpus, "--max-steps", 3), processes=1, cap_s=90),
        ScriptRun("ch6_overhead.py", ("--steps", 3, "--rounds", 1), cap_s=90),
        ScriptRun("ch7_compile_benchmark.py", (*tiny, "--steps", 3, "--warmup", 1,
                                               "--cache-dir", scratch / "inductor_cache"), cap_s=150),
        ScriptRun("ch7_profile_fsdp.py", (*tiny, "--warmup", 1, "--trace-dir", scratch / "ch7_profile_fsdp")),
        ScriptRun("ch7_step_benchmark.py", (*tiny, "--steps", 2, "--warmup", 1)),
        ScriptRun("ch7_stragglers.py", skip="needs 2 or more processes: a straggler is one rank among others"),
        ScriptRun("ch8_experts.py", ("--tokens", 128, "--width", 32, "--steps", 1)),
        ScriptRun("ch8_mesh.py", ("--tp", 1, "--steps", 2), note="a mesh of dp 1 x tp 1"),
        ScriptRun("ch8_pipeline.py", (*tiny, "--batch-size", 4, "--microbatches", 1, 2, "--repeats", 1),
                  note="one stage"),
        ScriptRun("ch8_ring_attention.py", ("--seq-len", 128)),
        ScriptRun("ch8_tensor_parallel.py", (*tiny, "--batch-size", 2)),
    ]


def script_command(run: ScriptRun, metrics: Path) -> list[str]:
    """The command the every-script stage runs: the script's arguments, NCCL, ``--metrics``."""
    return command([run.script, *run.args, "--backend", "nccl"], run.processes, metrics)


def last_line(log: str) -> str:
    """The line that says why a run failed: its last error line, else its last line of text."""
    lines = [line.strip() for line in log.splitlines() if line.strip(" =-*\t")]
    errors = [line for line in lines if ERROR_LINE.search(line) and "ChildFailedError" not in line]
    return (errors or lines or [""])[-1][:200]


def every_script_stage(out: Path, deadline: float, jobs: int, log: MetricsWriter) -> None:
    """Run every_script_runs, ``jobs`` at a time, into out/every_script/; record each in ``log``."""
    folder = out / "every_script"
    folder.mkdir()
    threads = str(max(1, (os.cpu_count() or 1) // jobs))  # the cores, shared by the runs at a time

    def one(run: ScriptRun) -> tuple[list[str], int | str, float, str]:
        name = run.script.removesuffix(".py")
        argv, console = script_command(run, folder / f"{name}.jsonl"), folder / f"{name}.log"
        if run.skip:
            return argv, f"skipped: {run.skip}", 0.0, ""
        left = deadline - time.monotonic()
        if left < run.cap_s / 2:  # too little time to finish: skipped, and said so
            return argv, "skipped: budget spent", 0.0, ""
        status, seconds = run_capped(argv, min(run.cap_s, left), console,
                                     env={"OMP_NUM_THREADS": threads, **run.env})
        failed = status != 0 and console.exists()
        return argv, status, seconds, last_line(console.read_text(errors="replace")) if failed else ""

    with tempfile.TemporaryDirectory(prefix="gpu_results-") as scratch:  # traces, caches: not kept
        # The longest first, while the budget lasts; each is recorded as it ends.
        runs = sorted(every_script_runs(Path(scratch)), key=lambda run: -run.cap_s)
        print(f"every companion script on one process, {jobs} at a time:", flush=True)
        with ThreadPoolExecutor(jobs) as pool:
            for run, (argv, status, seconds, line) in zip(runs, pool.map(one, runs), strict=True):
                log.write(event="script", script=run.script, how=run.how(), command=argv[1:], status=status,
                          seconds=seconds, last_line=line, jobs=jobs)
                print(f"  {run.script:<26} {str(status)[:40]:<40} {seconds:6.1f} s", flush=True)


# ---------------------------------------------------------------- the precision table


def peak_flops(name: str) -> float | None:
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def precision_step(size: str, batch: int, mode: str, steps: int = 12) -> dict:
    """One AdamW step of the book's GPT in ``mode``, timed with CUDA events over ``steps``."""
    torch.manual_seed(0)
    cfg = MODEL_SIZES[size]
    # TF32 only where asked: fp32 means fp32 matmuls here, which is not PyTorch's default on
    # every version; set both ways so that each mode says what it measured.
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    model = GPT(cfg).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    forward = torch.compile(model) if mode == "bf16+compile" else model
    x, y = (torch.randint(cfg.vocab_size, (batch, cfg.context), device="cuda") for _ in "xy")

    def step():
        with torch.autocast("cuda", torch.bfloat16, enabled=mode.startswith("bf16")):
            loss = forward(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        loss = step()
    end.record()
    torch.cuda.synchronize()
    ms = begin.elapsed_time(end) / steps
    params = sum(p.numel() for p in model.parameters())
    tokens = batch * cfg.context
    # 6 N per token, plus attention's 12 L d T (PaLM, appendix B)
    flops = 6 * params * tokens + 12 * cfg.n_layer * cfg.n_embd * cfg.context * tokens
    peak = peak_flops(torch.cuda.get_device_name())
    torch.backends.cuda.matmul.allow_tf32 = False
    return {"model": size, "mode": mode, "params": params, "batch": batch, "ctx": cfg.context,
            "step_ms": ms, "first_s": first_s, "tokens_per_s": round(tokens / ms * 1e3),
            "mfu_bf16_peak": None if peak is None else flops / (ms / 1e3) / peak,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": loss.item()}


def precision_table(metrics: MetricsWriter, deadline: float) -> None:
    for size, batch in PRECISION_RUNS:
        for mode in gpu_report.MODES:
            if time.monotonic() > deadline:
                metrics.write(event="precision", model=size, mode=mode, error="skipped: budget spent")
                continue
            try:
                row = precision_step(size, batch, mode)
            except torch.OutOfMemoryError as err:
                row = {"model": size, "mode": mode, "error": f"out of memory: {err}"[:200]}
            metrics.write(event="precision", **row)
            print(f"  precision {size:<10} {mode:<12} {row.get('step_ms', float('nan')):8.1f} ms/step",
                  flush=True)
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- provenance and the runs


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO_ROOT)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def driver_version() -> str:
    """The NVIDIA driver's version, from nvidia-smi (absent in some containers: "unknown")."""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return smi.stdout.split("\n")[0].strip() if smi.returncode == 0 else "unknown"


def provenance() -> dict:
    commit = git("rev-parse", "--short", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    try:
        lightning = importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        lightning = None
    return {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(),
            "driver": driver_version(),
            "cuda": torch.version.cuda, "torch": torch.__version__, "lightning": lightning,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(), "commit": commit,
            "made_by": "scripts/gpu_results.py"}


def render(folder: Path) -> str:
    tables = gpu_report.render(gpu_report.load(folder))
    (folder / "tables.md").write_text(tables)
    return tables


def main() -> None:
    args = parse_args()
    if args.render:
        if not (args.render / "provenance.json").exists():
            raise ScriptError(f"{args.render} holds no provenance.json: not a measured folder")
        print(render(args.render))
        return
    if not torch.cuda.is_available():
        raise ScriptError("no CUDA GPU here: gpu_results.py measures GPUs, and this machine has "
                          "none (torch.cuda.is_available() is False); --render FOLDER needs none")
    deadline = time.monotonic() + args.budget_s
    prov = provenance()
    gpus = prov["gpu_count"]
    out = args.out or REPO_ROOT / "runs" / "gpu_results" / f"{prov['date']}_{prov['gpu'].replace(' ', '_')}"
    if out.exists() and any(out.iterdir()):
        raise ScriptError(f"{out} is not empty: the metrics files append, so pick another --out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    print(f"{gpus} × {prov['gpu']}, torch {prov['torch']}; writing {out}; budget {args.budget_s} s",
          flush=True)

    metrics = MetricsWriter(out / "precision.jsonl")
    metrics.write(event="provenance", **prov)
    precision_table(metrics, deadline)
    metrics.close()
    runs = one_gpu_runs(out, gpus) + (several_gpu_runs(gpus) if gpus >= 2 else [])
    log = MetricsWriter(out / "runs.jsonl")
    for name, script_and_args, processes, cap in runs:
        argv = command(script_and_args, processes, out / f"{name}.jsonl")
        left = deadline - time.monotonic()
        if left < cap / 2:  # too little time to finish: skipped, and said so
            status, seconds = "skipped: budget spent", 0.0
        else:
            status, seconds = run_capped(argv, min(cap, left), out / f"{name}.log")
        log.write(event="run", name=name, command=argv[1:], status=status, seconds=seconds)
        print(f"  {name:<16} {status!s:<24} {seconds:6.1f} s", flush=True)
    # Its own budget: the measurements' caps alone add up to more than theirs.
    every_script_stage(out, time.monotonic() + args.scripts_budget_s, args.jobs, log)
    log.close()
    print(render(out))


if __name__ == "__main__":
    run_main(main)
