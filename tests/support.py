"""Helpers for the tests: run a companion script the way a reader would."""

from __future__ import annotations

import importlib.util
import shlex
import sys

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
