"""Checkpoint I/O: atomic writes, RNG state, the newest readable checkpoint, weight fingerprints.

What a checkpoint holds and when it is written is the business of each training program (chapter
3 gathers every rank's RNG state to rank 0; chapter 4 writes sharded checkpoints); how bytes reach
the disk safely and how a damaged file is recognised is the same everywhere, and lives here.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from dtbook.cli import one_line


def atomic_save(obj, path: Path) -> None:
    """Write to a temporary file in the same directory, make it durable, then rename
    it into place.

    A crash at any moment leaves either the old state or the complete new file under
    ``path``, never a half-written one: rename within a directory is atomic, and the
    fsyncs make sure the bytes (and then the directory entry) reach the disk before
    we rely on them.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                               dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def checkpoint_paths(ckpt_dir: Path, pattern: str = "ckpt_step*.pt") -> list[Path]:
    """Finished checkpoints, oldest first (temporary files of an interrupted write never match)."""
    return sorted(ckpt_dir.glob(pattern))


def newest_loadable(paths: Iterable[Path], required_keys: set[str]) -> Path | None:
    """The newest of ``paths`` (oldest first) that loads and holds ``required_keys``,
    else None.

    Each candidate is validated on the CPU and memory-mapped, so validating costs
    neither device memory nor a full read; the caller then loads the chosen file
    once, where it needs it. An unreadable file (truncated by a full disk, corrupted
    by a copy) is reported and skipped.
    """
    for path in reversed(list(paths)):
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            missing = required_keys - set(ckpt)
            if missing:
                raise ValueError(f"missing {sorted(missing)}")
            return path
        except Exception as err:  # whatever makes a file unusable: try an older one
            print(f"warning: skipping unreadable checkpoint {path}: {one_line(err)}",
                  file=sys.stderr, flush=True)
    return None


def capture_rng_state(device: torch.device) -> dict:
    """This process's random number generators, as tensors and tuples that weights_only loading accepts."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def weights_fingerprint(model: torch.nn.Module) -> dict:
    """Numbers that identify a set of weights: equal weights give equal fingerprints on any world size."""
    return state_dict_fingerprint(model.state_dict())


def state_dict_fingerprint(state_dict: dict[str, torch.Tensor]) -> dict:
    """``weights_fingerprint`` of a full (unsharded) state dict, such as a sharded model gathers to rank 0."""
    digest = hashlib.sha256()
    abs_sum = 0.0
    for name, tensor in state_dict.items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
        abs_sum += tensor.double().abs().sum().item()
    return {"weights_sha256": digest.hexdigest(), "weights_abs_sum": abs_sum}
