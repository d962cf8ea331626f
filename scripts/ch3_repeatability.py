"""Does the same command give the same weights? Run it N times and count the distinct results.

    python scripts/ch3_repeatability.py --runs 10                  # 10 identical runs, 2 processes
    python scripts/ch3_repeatability.py --runs 10 --kill-resume    # and 10 kill-and-resume runs
    python scripts/ch3_repeatability.py --runs 50 --kill-resume --hog   # the soak: half beside a CPU hog
    python scripts/ch3_repeatability.py --benchmark                # what reproducible CPU math costs

The repetition harness of chapter 3: it launches scripts/ch3_train.py under torchrun again and
again with one configuration and compares the sha256 of the final weights that each run reports.
A deterministic program gives one hash, however often it runs and whatever else the machine is
doing; one lucky pass proves nothing. With --kill-resume every run is killed (SIGKILL of a random
rank after a random step, drawn from the run's index) and resumed from its newest checkpoint, and
must end with the uninterrupted run's hash. With --hog every other run has a busy-loop process
beside it, so scheduling, timing and memory layout differ from run to run.

--mkl-cbwr sets MKL_CBWR for the runs: the default keeps the book's setting (AUTO,STRICT, see
scripts/dtbook/reproducibility.py); an empty value ("--mkl-cbwr ''") means MKL's own default, to
see what the setting is for. --benchmark times training steps both ways and prints a table.
"""

import argparse
import contextlib
import random
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from dtbook.cli import ScriptError, add_backend_and_metrics, positive_int, run_main, script_parser
from dtbook.launch import launch_torchrun
from dtbook.metrics import MetricsWriter
from dtbook.reproducibility import REPRODUCIBLE_CPU_MATH

BOOK_SETTING = REPRODUCIBLE_CPU_MATH["MKL_CBWR"]


def parse_args() -> argparse.Namespace:
    parser = script_parser(__doc__)
    add = parser.add_argument
    add("--runs", type=positive_int, default=10, help="runs per check (default 10)")
    add("--kill-resume", action="store_true", help="also run the kill-and-resume check --runs times")
    add("--hog", action="store_true", help="run every other run beside a CPU busy-loop")
    add("--mkl-cbwr", default=BOOK_SETTING,
        help=f"MKL_CBWR for the runs (default {BOOK_SETTING}; '' for MKL's own default)")
    add("--benchmark", action="store_true",
        help="time ch3_train.py's steps with and without reproducible MKL instead")
    add("--nproc", type=positive_int, default=2, help="processes per run (default 2)")
    add("--model", default="small", help="ch3_train.py --model (default small)")
    add("--max-steps", type=positive_int, default=40, help="optimizer steps per run (default 40)")
    add("--dropout", default="0.1", help="ch3_train.py --dropout (default 0.1: the RNG matters too)")
    add("--timeout", type=positive_int, default=300, help="seconds one run may take (default 300)")
    add_backend_and_metrics(parser)
    args = parser.parse_args()
    if args.kill_resume and args.max_steps < 3:
        parser.error("--kill-resume needs --max-steps of at least 3 (kill after a step, then resume)")
    return args


def train(args, extra: list, env: dict) -> dict:
    """One ch3_train.py run; returns its summary record (weights_sha256, samples_per_s, ...)."""
    run = launch_torchrun("ch3_train.py", ["--model", args.model, "--max-steps", args.max_steps,
                                           "--dropout", args.dropout, "--log-every", args.max_steps,
                                           "--backend", args.backend, *extra],
                          nproc=args.nproc, timeout=args.timeout, env=env, quiet=True)
    return run.records("summary")[-1]


def kill_and_resume(args, index: int, env: dict, workdir: Path) -> dict:
    """Kill a random rank after a random step (both drawn from ``index``), then resume to the end."""
    draw = random.Random(index)
    crash_step, crash_rank = draw.randint(1, args.max_steps - 1), draw.randrange(args.nproc)
    ckpt = workdir / f"ckpt{index}"
    shutil.rmtree(ckpt, ignore_errors=True)
    checkpointing = ["--checkpoint-dir", ckpt, "--save-every", max(1, args.max_steps // 4), "--keep", 10]
    try:
        train(args, [*checkpointing, "--crash-at-step", crash_step, "--crash-rank", crash_rank], env)
    except RuntimeError:
        pass  # the crash is the point; the resumed run below must prove nothing was lost
    else:
        raise ScriptError(f"run {index}: the fault injection after step {crash_step} did not fire")
    return train(args, [*checkpointing, "--resume"], env)


class CpuHog:
    """A busy loop on another core for as long as the context lasts."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def repeat(args, check: str, run_once, metrics) -> Counter:
    hashes = Counter()
    for index in range(args.runs):
        beside_hog = args.hog and index % 2 == 1
        with CpuHog() if beside_hog else contextlib.nullcontext():
            summary = run_once(index)
        hashes[summary["weights_sha256"][:12]] += 1
        metrics.write(event="run", check=check, index=index, beside_hog=beside_hog,
                      weights_sha256=summary["weights_sha256"])
        print(f"{check} run {index + 1}/{args.runs}{' (beside a CPU hog)' if beside_hog else ''}: "
              f"weights {summary['weights_sha256'][:12]}", flush=True)
    return hashes


def benchmark(args, metrics) -> None:
    """Samples per second of the same training, MKL's default against the reproducible setting."""
    rows = []
    for label, value in (("MKL default (MKL_CBWR='')", ""), (f"MKL_CBWR={BOOK_SETTING}", BOOK_SETTING)):
        rates = [train(args, [], {"MKL_CBWR": value})["samples_per_s"] for _ in range(args.runs)]
        rates.sort()
        rows.append((label, rates[len(rates) // 2]))
        metrics.write(event="benchmark", setting=value, samples_per_s=rates)
    print(f"\n{'setting':<32}{'median samples/s':>18}{'relative':>10}")
    for label, rate in rows:
        print(f"{label:<32}{rate:>18,.0f}{rate / rows[0][1]:>10.3f}")


def main() -> None:
    args = parse_args()
    metrics = MetricsWriter(args.metrics)
    env = {"MKL_CBWR": args.mkl_cbwr}
    metrics.write(event="config", runs=args.runs, nproc=args.nproc, model=args.model, max_steps=args.max_steps,
                  dropout=args.dropout, mkl_cbwr=args.mkl_cbwr, hog=args.hog)
    if args.benchmark:
        benchmark(args, metrics)
        return
    results = {"same command": repeat(args, "same command", lambda i: train(args, [], env), metrics)}
    if args.kill_resume:
        reference = train(args, [], env)["weights_sha256"][:12]
        with tempfile.TemporaryDirectory(prefix="ch3_repeatability-") as tmp:
            results["kill and resume"] = repeat(
                args, "kill and resume", lambda i: kill_and_resume(args, i, env, Path(tmp)), metrics)
        matching = results["kill and resume"][reference]
    print(f"\nMKL_CBWR={args.mkl_cbwr!r}, {args.nproc} processes, GPT-{args.model}, {args.max_steps} steps")
    print(f"{'check':<18}{'runs':>6}{'distinct results':>18}{'most common':>14}")
    for check, hashes in results.items():
        print(f"{check:<18}{args.runs:>6}{len(hashes):>18}{hashes.most_common(1)[0][1]:>14}")
        metrics.write(event="result", check=check, runs=args.runs, distinct=len(hashes),
                      most_common=hashes.most_common(1)[0][1])
    if args.kill_resume:
        print(f"kill and resume runs ending with the uninterrupted run's weights: {matching}/{args.runs}")
        metrics.write(event="kill_resume", matching_uninterrupted=matching, runs=args.runs)
    metrics.close()
    if any(len(hashes) > 1 for hashes in results.values()) or (args.kill_resume and matching != args.runs):
        raise ScriptError("not reproducible: the runs above did not all end with the same weights")


if __name__ == "__main__":
    run_main(main)
