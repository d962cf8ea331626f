"""Helpers for the tests: run a companion script the way a reader would."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from dtbook.paths import REPO_ROOT as REPO
from dtbook.paths import SCRIPTS_DIR as SCRIPTS

BIN = Path(sys.executable).parent


def _env(extra: dict | None) -> dict:
    """This process's environment, one thread per process, plus ``extra`` (a value of None unsets)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.update(extra or {})
    return {name: value for name, value in env.items() if value is not None}


def run_torchrun(script: str, *args, nproc: int = 2, timeout: float = 300, env: dict | None = None,
                 check: bool = True, torchrun_args: tuple = ()) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=N scripts/<script> args...``; output captured as text."""
    command = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *map(str, torchrun_args),
               str(SCRIPTS / script), *map(str, args)]
    return _run(command, timeout, env, check)


def run_python(script: str, *args, timeout: float = 300, env: dict | None = None,
               check: bool = True) -> subprocess.CompletedProcess:
    """``python scripts/<script> args...`` with no launcher: a world of one."""
    return _run([sys.executable, str(SCRIPTS / script), *map(str, args)], timeout, env, check)


def _run(command, timeout, env, check) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env(env), cwd=REPO)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {done.returncode}\n--- stdout\n{done.stdout}\n"
                             f"--- stderr\n{done.stderr}")
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
