"""Helpers for the tests: run a companion script the way a reader would."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from dtbook.cli import ScriptError
from dtbook.launch import RunResult, launch_python, launch_torchrun
from dtbook.paths import REPO_ROOT as REPO  # noqa: F401  (the tests import it from here)
from dtbook.paths import SCRIPTS_DIR as SCRIPTS


def run_torchrun(script: str, *args, nproc: int = 2, timeout: float = 300, env: dict | None = None,
                 check: bool = True, torchrun_args: tuple = ()) -> RunResult:
    """``torchrun --standalone --nproc_per_node=N scripts/<script> args...`` through the notebooks' launcher.

    Quiet (the output is in ``.output``, stdout and stderr together), one thread per process, no
    ``--metrics`` added; ``env`` values of None unset a variable; ``torchrun_args`` go to torchrun
    after the two above. With ``check`` a failed run fails the test with its output.
    """
    launcher = ["--standalone", f"--nproc_per_node={nproc}", *map(str, torchrun_args)]
    done = launch_torchrun(script, args, nproc=nproc, timeout=timeout, env=env, metrics=False, check=False,
                           quiet=True, threads_per_process=1, torchrun_args=launcher)
    return _checked(done, check)


def run_python(script: str, *args, timeout: float = 300, env: dict | None = None, check: bool = True) -> RunResult:
    """``python scripts/<script> args...`` with no launcher (a world of one), like ``run_torchrun``."""
    done = launch_python(script, args, timeout=timeout, env=env, metrics=False, check=False, quiet=True,
                         threads_per_process=1)
    return _checked(done, check)


def _checked(done: RunResult, check: bool) -> RunResult:
    if check and done.returncode != 0:
        raise AssertionError(f"{shlex.join(done.command)} exited {done.returncode}\n{done.output}")
    return done


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def load_script(script: str):
    """Import ``scripts/<script>`` as a module (its ``main`` does not run)."""
    path = SCRIPTS / script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_in_process(script: str, *args, monkeypatch) -> int:
    """Run the script's ``main`` through ``run_main`` in this process; return its exit code.

    Only for inputs that fail before ``init_process_group``: it is the cheap way to test a
    script's one-line errors (milliseconds instead of a Python start-up). The launcher variables
    the script fills in for a world of one are restored afterwards.
    """
    from dtbook.cli import run_main

    for name in LAUNCHER_VARIABLES:
        monkeypatch.setenv(name, "")  # so that monkeypatch restores the variable's absence
        monkeypatch.delenv(name)
    module = load_script(script)
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    try:
        run_main(module.main)
    except SystemExit as exit_:
        return exit_.code
    raise AssertionError(f"{script} {args} did not exit: it was expected to fail before init_process_group")


def assert_inputs_checked(program, args, world: int, problem: str | None) -> None:
    """``program.check_inputs(args, world)`` accepts, or refuses with one line naming ``problem``."""
    if problem is None:
        program.check_inputs(args, world)
        return
    with pytest.raises(ScriptError, match=problem) as refused:
        program.check_inputs(args, world)
    assert "\n" not in str(refused.value)


# --------------------------------------------------------------------------------------------
# The hand-written parallel modules in another dtype and on another device (test_device_dtype.py)
# --------------------------------------------------------------------------------------------

TESTS = Path(__file__).resolve().parent

# A float64 computation and the same one with its sums in another order (2 ranks, 1 process)
# agree to a few 1e-16 relative (float64's unit roundoff is 1.1e-16); float32's (6e-8) leaves
# 1e-9 to 1e-6 (dtype_worker.py's runs: float64 1e-17 to 4e-16, float32 5e-9 to 2e-7). A gap of
# at most FLOAT64_GAP, MARGIN times inside, is float64's alone; the same comparisons in float32
# must be MARGIN times outside it: the control that says the module really ran in float64.
FLOAT64_GAP = 1e-12


def float64_runs(chapter: str, tmp_path: Path) -> dict:
    """``tests/dtype_worker.py CHAPTER`` on 2 processes with gloo on the CPU: its results."""
    out = tmp_path / f"{chapter}.json"
    run_torchrun(str(TESTS / "dtype_worker.py"), chapter, out, nproc=2, timeout=180,
                 env={"CUDA_VISIBLE_DEVICES": ""})
    return json.loads(out.read_text())


def assert_float64_agreement(module: str, runs: dict) -> None:
    """One module's float64 run equals one process's to float64 resolution, in float64.

    ``runs``: the worker's ``{"float64": {...}, "float32": {...}}``. Every gap is a relative L2
    gap (``dtbook.compare.training_gap``), so the tolerance is scaled by what is compared.
    """
    from dtbook.compare import MARGIN

    float64, float32 = runs["float64"], runs["float32"]
    print(f"{module}: float64 gaps {float64['gaps']}, float32 gaps {float32['gaps']}")
    for dtype, run in runs.items():  # every output, parameter, gradient, buffer, state
        assert all(found == [dtype] for found in run["dtypes"].values()), (module, run["dtypes"])
    for name, gap in float64["gaps"].items():
        assert gap <= FLOAT64_GAP / MARGIN, f"{module} in float64: {name} gap {gap:.1e}"
    worst32 = max(float32["gaps"].values())
    assert worst32 >= FLOAT64_GAP * MARGIN, (
        f"{module}: the float32 control's gaps {float32['gaps']} meet the float64 tolerance "
        f"{FLOAT64_GAP:.0e}: it cannot tell float64 from float32")


COMMUNICATION = ("all_reduce", "broadcast", "all_gather", "all_gather_single",
                 "reduce_scatter_single", "all_to_all_single", "send", "recv", "isend", "irecv")


@contextmanager
def world_without_communication(rank: int, world: int):
    """A process group of ``world`` ranks in this process, this one ``rank``, that talks to no one.

    torch's fake backend: every collective and send/recv returns at once and leaves its output
    as it was, on any device (gloo refuses meta tensors), and checks no dtype. Enough to build
    a parallel module on the meta device and run its forward and backward, where shapes, dtypes
    and devices follow the data while no value does. Yields the list of every tensor handed to
    a ``torch.distributed`` call meanwhile (buffers sent, received, reduced). The group is
    destroyed afterwards, whatever happened.
    """
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "another process group is still alive in this process"
    communicated: list = []

    def recording(call):
        def wrapper(*args, **kwargs):
            for arg in (*args, *kwargs.values()):
                parts = arg if isinstance(arg, (list, tuple)) else [arg]
                communicated.extend(t for t in parts if isinstance(t, torch.Tensor))
            return call(*args, **kwargs)
        return wrapper

    originals = {name: getattr(dist, name) for name in COMMUNICATION}
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        for name, call in originals.items():
            setattr(dist, name, recording(call))
        yield communicated
    finally:
        for name, call in originals.items():
            setattr(dist, name, call)
        dist.destroy_process_group()


def assert_on(device: str, dtype, **tensors) -> None:
    """Every tensor of every named group is on ``device`` (a type: "meta") and in ``dtype``."""
    for name, group in tensors.items():
        found = {(t.device.type, t.dtype) for t in group}
        assert found == {(device, dtype)}, f"{name}: {sorted(map(str, found))}"
