"""Command-line plumbing every companion script shares: one-line errors and argparse helpers.

A reader who mistypes a flag or asks for an impossible size gets one line that names the problem
and a non-zero exit, never a traceback wall. Bugs in our own code still show their traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time


class ScriptError(Exception):
    """A problem with the inputs or environment, reported as one line.

    ``linger_s``: seconds the process stays after its line before it exits. torchrun stops
    every worker as soon as one exits with an error, so a rank that fails moments after a
    partner would otherwise be killed before it reports.
    """

    def __init__(self, message: str, linger_s: float = 0.0):
        super().__init__(message)
        self.linger_s = linger_s


def run_main(main) -> None:
    """Call ``main()``; turn a ScriptError into one line on stderr and exit 2.

    Genuine bugs still show their traceback: those are for us to fix, while a
    ScriptError is for the reader to fix and a traceback would only bury it.
    """
    try:
        main()
    except ScriptError as err:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        # One write, newline included: under `python -u` print() writes the text and the newline
        # separately, and two ranks' lines on torchrun's shared pipe could interleave between them.
        # A write(2) to a pipe is atomic up to PIPE_BUF (4096 bytes on Linux, 512 on macOS), which
        # a one-line error stays well under.
        sys.stderr.write(f"{prefix}error: {err}\n")
        sys.stderr.flush()
        time.sleep(err.linger_s)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


def positive_int(text: str) -> int:
    """argparse type for sizes and counts that must be at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type for rates and sizes that must be greater than zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number greater than 0, got {text}")
    return value


def script_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose --help shows the script's docstring as written, usage examples included."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_backend_and_metrics(parser: argparse.ArgumentParser) -> None:
    """The two flags every companion script has: which backend, and where rank 0 writes its metrics."""
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="process-group backend (default: nccl if every local rank has a GPU, else gloo)")
    parser.add_argument("--metrics", help="rank 0 appends JSON lines here")


def one_line(err: BaseException) -> str:
    """An exception as one short line: torch.load's messages, for one, run to several paragraphs."""
    text = str(err).strip()
    first_sentence = text.splitlines()[0].split(". ")[0][:160] if text else "no detail"
    return f"{type(err).__name__}: {first_sentence}"



BYTE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def byte_size(text: str) -> int:
    """argparse type for a size in bytes: 4096, 64KiB, 256MiB (binary units); at least 1."""
    unit = next((u for u in ("KiB", "MiB", "GiB", "B") if text.endswith(u)), "B")
    try:
        value = float(text.removesuffix(unit)) * BYTE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 4096, 64KiB or 256MiB, got {text!r}") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number of bytes, at least 1, got {text}")
    return int(value)


def format_bytes(nbytes: float) -> str:
    """4 B, 64 KiB, 1.5 MiB: the largest binary unit that keeps the number at least 1."""
    unit = next(u for u in ("GiB", "MiB", "KiB", "B") if nbytes >= BYTE_UNITS[u] or u == "B")
    return f"{nbytes / BYTE_UNITS[unit]:g} {unit}"


def check_training_inputs(args: argparse.Namespace, world_size: int, num_windows: int) -> None:
    """The training programs' checks that need no process group, so bad input fails fast:
    one global batch fits the corpus, ``--crash-rank`` (default: the last rank) is a rank, and
    ``--checkpoint-dir`` can be written. Sets ``args.crash_rank``."""
    global_batch = world_size * args.batch_size * args.accum_steps
    if num_windows // global_batch == 0:
        raise ScriptError(
            f"one optimizer step needs {world_size} process(es) x --batch-size {args.batch_size} x "
            f"--accum-steps {args.accum_steps} = {global_batch} windows, but the corpus has "
            f"only {num_windows}: lower those or raise --corpus-tokens")
    crash_rank = world_size - 1 if args.crash_rank is None else args.crash_rank
    if args.crash_at_step and not 0 <= crash_rank < world_size:
        raise ScriptError(f"--crash-rank {crash_rank} is not a rank of this world of {world_size}")
    args.crash_rank = crash_rank
    if args.checkpoint_dir:
        try:
            args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=args.checkpoint_dir):
                pass
        except OSError as err:
            raise ScriptError(f"cannot write to --checkpoint-dir {args.checkpoint_dir}: {err}") from None
