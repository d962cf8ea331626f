"""Checkpoint I/O: an interrupted write never replaces a good file, a damaged file is skipped."""

import random

import pytest
import torch

from dtbook.checkpoint import (
    atomic_save,
    capture_rng_state,
    checkpoint_paths,
    newest_loadable,
    restore_rng_state,
    weights_fingerprint,
)
from dtbook.model import GPT, MODEL_SIZES


class ExplodesWhilePickled:
    def __reduce__(self):
        raise RuntimeError("disk full, say")


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "ckpt_step00000001.pt"
    atomic_save({"step": 1}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        atomic_save({"step": 2, "bad": ExplodesWhilePickled()}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_newest_loadable_skips_a_damaged_and_an_incomplete_checkpoint(tmp_path, capsys):
    keys = {"model", "step"}
    for step in (1, 2, 3):
        atomic_save({"model": {}, "step": step}, tmp_path / f"ckpt_step{step:08d}.pt")
    (tmp_path / "ckpt_step00000003.pt").write_bytes(b"not a checkpoint")  # corrupted by a bad copy
    atomic_save({"model": {}}, tmp_path / "ckpt_step00000004.pt")  # no step: not ours
    (tmp_path / ".ckpt_step00000005.pt.tmp").write_bytes(b"half")  # an interrupted write
    paths = checkpoint_paths(tmp_path)
    assert [p.name for p in paths] == [f"ckpt_step{s:08d}.pt" for s in (1, 2, 3, 4)]
    assert newest_loadable(paths, keys) == tmp_path / "ckpt_step00000002.pt"
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and "missing ['step']" in warnings[0] and "00000003" in warnings[1]


def test_newest_loadable_of_nothing_readable_is_none(tmp_path):
    (tmp_path / "ckpt_step00000001.pt").write_bytes(b"\0" * 10)
    assert newest_loadable(checkpoint_paths(tmp_path), {"step"}) is None


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(7)
    random.seed(7)
    atomic_save(capture_rng_state(torch.device("cpu")), tmp_path / "rng.pt")
    expected = (torch.rand(3), random.random())
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), torch.device("cpu"))
    again = (torch.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1]


def test_the_fingerprint_tells_equal_weights_from_nearly_equal_ones():
    torch.manual_seed(0)
    a, b = GPT(MODEL_SIZES["tiny"]), GPT(MODEL_SIZES["tiny"])
    b.load_state_dict(a.state_dict())
    assert weights_fingerprint(a) == weights_fingerprint(b)
    with torch.no_grad():
        b.ln_f.bias[0] += 1e-7  # one entry, one rounding step away
    assert weights_fingerprint(a)["weights_sha256"] != weights_fingerprint(b)["weights_sha256"]
