"""Helpers for the tests: run a companion script the way a reader would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dtbook.paths import REPO_ROOT as REPO
from dtbook.paths import SCRIPTS_DIR as SCRIPTS

BIN = Path(sys.executable).parent


def _env(extra: dict | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.update(extra or {})
    return env


def run_torchrun(script: str, *args, nproc: int = 2, timeout: float = 300, env: dict | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=N scripts/<script> args...``; output captured as text."""
    command = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", str(SCRIPTS / script),
               *map(str, args)]
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
