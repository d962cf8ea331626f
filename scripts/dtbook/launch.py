"""Run a companion script from a notebook: under torchrun, as several "nodes", or as plain python.

Notebooks never run distributed code in their own kernel. They call ``launch_torchrun``, which
prints the exact command (a reader can paste it into a terminal), streams the script's output,
enforces a deadline by killing the whole process group, raises when the script fails, and returns
the metrics that rank 0 wrote. This module does not import torch.

When ``DTBOOK_LAUNCH_LOG`` names a file, every launch appends the script's name to it: the book
builder uses that to know which scripts an executed notebook depends on.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from dtbook.metrics import describe_provenance, read_metrics
from dtbook.output_filters import AgentTracebackFilter, ExitBarrierRaceFilter
from dtbook.paths import REPO_ROOT, RUNS_DIR, SCRIPTS_DIR
from dtbook.ports import free_port

LAUNCH_LOG_VARIABLE = "DTBOOK_LAUNCH_LOG"
T = TypeVar("T")


@dataclass
class RunResult:
    command: list[str]
    returncode: int
    output: str
    seconds: float
    metrics: list[dict] = field(default_factory=list)

    @property
    def provenance(self) -> dict | None:
        return next((m for m in self.metrics if m.get("event") == "provenance"), None)

    def records(self, event: str) -> list[dict]:
        return [m for m in self.metrics if m.get("event") == event]

    def show(self, *needles: str, width: int = 150) -> None:
        """Say how the run ended, then print each distinct output line holding one of the needles.

        A failing run prints a traceback per rank and torchrun's summary; this picks out the lines
        that tell the story, each cut to ``width`` characters. ``output`` still holds everything.
        """
        print(f"exit status {self.returncode} after {self.seconds:.1f} s, "
              f"{len(self.output.splitlines())} lines of output")
        shown = set()
        for line in self.output.splitlines():
            if any(needle in line for needle in needles) and line not in shown:
                shown.add(line)
                print(line if len(line) <= width else line[:width] + " …")


def launch_torchrun(
    script: str,
    args: list[str] | tuple[str, ...] = (),
    nproc: int = 2,
    timeout: float = 300,
    metrics: bool = True,
    check: bool = True,
    torchrun_args: list[str] | tuple[str, ...] | None = None,
    env: dict | None = None,
    threads_per_process: int | None = None,
    quiet: bool = False,
    stream: bool = True,
) -> RunResult:
    """Run ``scripts/<script>`` under torchrun, streaming its output.

    Prints the exact command first (with the variables of ``env`` in front), so a reader can
    paste it into a terminal. ``stream=False`` keeps the output in the result instead of
    printing it, for a cell that shows selected lines; ``quiet=True`` prints nothing at all.
    With ``metrics=True`` a fresh ``--metrics PATH`` is appended to the script's
    arguments and the JSON lines rank 0 wrote are returned. On a timeout or an
    interrupt the whole process group (agent and workers) is killed. With
    ``check=True`` a non-zero exit raises, because a plain ``!torchrun`` in a
    notebook cell would let a failed run pass unnoticed.
    """
    script_path = _script_path(script)
    launcher = [find_torchrun()]
    if torchrun_args is None:
        torchrun_args = ["--standalone", f"--nproc_per_node={nproc}"]
    args, metrics_path = _script_args(script_path, args, metrics)
    command = [*launcher, *torchrun_args, str(script_path), *args]
    if not quiet:
        _say("$ " + _shown_command(["torchrun", *torchrun_args], script_path, args, metrics_path, env))

    cores = os.cpu_count() or 1
    run_env = _child_env(env, threads_per_process or max(1, cores // max(1, nproc)))
    result, _ = _run_commands(script, [command], [""], metrics_path, timeout, check, run_env, quiet, stream)
    return result


@dataclass
class NodesRunResult(RunResult):
    """A run made of several torchrun agents, one per pretend node."""

    commands: list[list[str]] = field(default_factory=list)  # commands[i] started node i's agent
    agent_pids: list[int] = field(default_factory=list)  # agent_pids[i]: process id of node i's agent
    returncodes: list[int] = field(default_factory=list)  # returncodes[i]: how node i's agent exited


def launch_torchrun_nodes(
    script: str,
    args: list[str] | tuple[str, ...] = (),
    nnodes: int = 2,
    nproc_per_node: int = 1,
    rdzv_backend: str = "c10d",
    timeout: float = 300,
    metrics: bool = True,
    check: bool = True,
    env: dict | None = None,
    threads_per_process: int | None = None,
    quiet: bool = False,
    lab=None,
    min_nodes: int | None = None,
    torchrun_args: list[str] | tuple[str, ...] = (),
    rdzv_endpoint: str | None = None,
    absent_nodes: list[int] | tuple[int, ...] = (),
    stream: bool = True,
) -> NodesRunResult:
    """Play ``nnodes`` machines on this one: start one torchrun agent per "node".

    Agent i gets ``--nnodes=N --node_rank=i --nproc_per_node=P`` and all agents
    meet at one rendezvous on 127.0.0.1, as agents on separate hosts meet at the
    first host's address. ``rdzv_backend="c10d"`` passes ``--rdzv-backend=c10d
    --rdzv-endpoint --rdzv-id`` (the rendezvous then assigns node ranks itself);
    ``"static"`` passes ``--master-addr/--master-port`` (``--node_rank`` is
    honored). Output lines are prefixed with their node; metrics, streaming,
    ``stream`` and the timeout and clean-up work as in ``launch_torchrun``, for every agent.

    With ``lab`` (a ``dtbook.cluster_lab.ClusterLab``) agent i runs on the lab's
    node i instead: in its network namespace, under its host name, with
    ``GLOO_SOCKET_IFNAME`` set to its interface unless ``env`` sets it, and the
    rendezvous is hosted at node 0's name. ``min_nodes`` makes the job elastic
    (``--nnodes=MIN:N``); ``torchrun_args`` go to every agent (``--max-restarts``,
    ``--rdzv-conf``); ``rdzv_endpoint`` replaces the meeting point; the agents of
    ``absent_nodes`` are never started, like nodes that never come up.
    """
    if rdzv_backend not in ("c10d", "static"):
        raise ValueError(f"rdzv_backend must be 'c10d' or 'static', got {rdzv_backend!r}")
    if lab is not None and nnodes > len(lab.nodes):
        raise ValueError(f"{nnodes} nodes asked for, but the lab has {len(lab.nodes)}")
    script_path = _script_path(script)
    launcher = [find_torchrun()]
    args, metrics_path = _script_args(script_path, args, metrics)
    port = free_port()
    host = "127.0.0.1" if lab is None else lab.nodes[0].hostname
    if rdzv_backend == "c10d":
        endpoint = rdzv_endpoint or f"{host}:{port}"
        meeting = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id=book-{port}"]
    else:
        meeting = [f"--master-addr={host}", f"--master-port={port}"]
    node_count = f"{min_nodes}:{nnodes}" if min_nodes is not None else str(nnodes)
    # A c10d rendezvous assigns node ranks itself; the lab's commands, which readers copy, leave it out.
    ranked = lab is None or rdzv_backend == "static"
    per_node = [[f"--nnodes={node_count}", *([f"--node_rank={node}"] if ranked else []),
                 f"--nproc_per_node={nproc_per_node}", *meeting, *torchrun_args] for node in range(nnodes)]
    started = [node for node in range(nnodes) if node not in absent_nodes]
    commands = [[*launcher, *per_node[node], str(script_path), *args] for node in started]
    names = [f"node {node}" if lab is None else lab.nodes[node].hostname for node in started]
    if lab is not None:
        commands = [lab.node_command(node, command) for node, command in zip(started, commands, strict=True)]
        env = {"GLOO_SOCKET_IFNAME": lab.nodes[0].interface, **(env or {})}
    if not quiet:
        shown = [_shown_command(["torchrun", *per_node[node]], script_path, args, metrics_path,
                                None if lab is not None else env) for node in started]
        if lab is not None and len(set(shown)) == 1:  # a c10d rendezvous: every node runs the same line
            _say(f"$ {shown[0]}   # on {', '.join(names)}")
        else:
            for line, name in zip(shown, names, strict=True):
                _say(f"$ {line}   # {'on ' if lab is not None else ''}{name}")
        if lab is not None:
            _say(f"  (every node: GLOO_SOCKET_IFNAME={env['GLOO_SOCKET_IFNAME']})")

    cores = os.cpu_count() or 1
    run_env = _child_env(env, threads_per_process or max(1, cores // max(1, nnodes * nproc_per_node)))
    labels = [f"[{name}] " for name in names]
    result, procs = _run_commands(script, commands, labels, metrics_path, timeout, check, run_env, quiet,
                                  stream, filters=(AgentTracebackFilter, ExitBarrierRaceFilter))
    return NodesRunResult(**vars(result), commands=commands, agent_pids=[p.pid for p in procs],
                          returncodes=[p.returncode for p in procs])


def launch_python(
    script: str,
    args: list[str] | tuple[str, ...] = (),
    timeout: float = 300,
    metrics: bool = True,
    check: bool = True,
    env: dict | None = None,
    threads_per_process: int | None = None,
    quiet: bool = False,
    stream: bool = True,
) -> RunResult:
    """Run ``python scripts/<script> args...`` without a launcher; otherwise like ``launch_torchrun``.

    For scripts that start their own processes (``torch.multiprocessing.spawn``)
    and for a world of one. ``threads_per_process`` sets ``OMP_NUM_THREADS``
    unless the environment already sets it.
    """
    script_path = _script_path(script)
    args, metrics_path = _script_args(script_path, args, metrics)
    command = [sys.executable, str(script_path), *args]
    if not quiet:
        _say("$ " + _shown_command(["python"], script_path, args, metrics_path, env))
    run_env = _child_env(env, threads_per_process)
    result, _ = _run_commands(script, [command], [""], metrics_path, timeout, check, run_env, quiet, stream)
    return result


def side_by_side(launch: Callable[[T], RunResult], variants: Iterable[T]) -> dict[T, RunResult]:
    """``{v: launch(v) for v in variants}``, with the launches running at the same time.

    For runs that check results, never for runs that time something: side by side they share
    the cores. What they overlap is mostly start-up (launchers and workers importing torch,
    one core busy while the other waits), about a quarter of two short runs here.
    """
    variants = list(variants)
    with ThreadPoolExecutor(max_workers=max(1, len(variants))) as pool:
        return dict(zip(variants, pool.map(launch, variants), strict=True))


def _say(line: str) -> None:
    """Print ``line`` in one write, so that launches side by side never split each other's lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _script_path(script: str) -> Path:
    """The companion script's path; the launch is recorded for the book builder's dependency tracking."""
    script_path = SCRIPTS_DIR / script
    if not script_path.exists():
        raise FileNotFoundError(f"no companion script {script_path}")
    log = os.environ.get(LAUNCH_LOG_VARIABLE)
    if log and script_path.resolve().is_relative_to(SCRIPTS_DIR):
        with open(log, "a") as f:
            f.write(script_path.resolve().relative_to(SCRIPTS_DIR).as_posix() + "\n")
    return script_path


def _script_args(script_path: Path, args, metrics: bool) -> tuple[list[str], str | None]:
    """The script's arguments as strings, plus ``--metrics`` and a fresh file under runs/ when asked.

    A ``Path`` inside the repository becomes relative to it, as a reader would type it there
    (scripts run in the repository root).
    """
    args = [_as_typed(a) for a in args]
    metrics_path = None
    if metrics:
        RUNS_DIR.mkdir(exist_ok=True)
        fd, metrics_path = tempfile.mkstemp(prefix=f"{script_path.stem}-", suffix=".jsonl", dir=RUNS_DIR)
        os.close(fd)
        args += ["--metrics", metrics_path]
    return args, metrics_path


def _as_typed(arg) -> str:
    if isinstance(arg, Path) and arg.resolve().is_relative_to(REPO_ROOT):
        return arg.resolve().relative_to(REPO_ROOT).as_posix()
    return str(arg)


def _shown_command(launcher: list[str], script_path: Path, args: list[str], metrics_path: str | None,
                   env: dict | None = None) -> str:
    """The command as a reader would type it in the repository root, the run's variables in front."""
    shown = [*launcher, os.path.relpath(script_path, REPO_ROOT),
             *[os.path.relpath(a, REPO_ROOT) if a == metrics_path else a for a in args]]
    variables = [f"{name}={shlex.quote(str(value))}" for name, value in (env or {}).items() if value is not None]
    unset = [f"-u {name}" for name, value in (env or {}).items() if value is None]
    prefix = " ".join((["env", *unset] if unset else []) + variables)
    return (prefix + " " if prefix else "") + shlex.join(shown)


def _child_env(env: dict | None, threads: int | None) -> dict:
    """This process's environment plus ``env``; a value of None unsets that variable."""
    run_env = {**os.environ, **(env or {})}
    run_env = {name: value for name, value in run_env.items() if value is not None}
    if threads is not None:
        run_env.setdefault("OMP_NUM_THREADS", str(threads))
    run_env["PYTHONUNBUFFERED"] = "1"
    return run_env


def _run_commands(script, commands, labels, metrics_path, timeout, check, run_env, quiet, stream,
                  filters=None) -> tuple[RunResult, list]:
    """Start each command in its own process group, stream their output, enforce one deadline.

    Each process's output passes through fresh instances of ``filters`` (classes), in
    order; the default is ``AgentTracebackFilter`` alone.
    Returns the result and the finished processes. On a timeout or an interrupt every
    group is killed; with ``check`` any non-zero exit raises.
    """
    import selectors

    filters = filters or (AgentTracebackFilter,)
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=run_env,
            cwd=REPO_ROOT,
            start_new_session=True,  # its own process group, so we can kill agent and workers together
        )
        for command in commands
    ]
    lines: list[str] = []
    timed_out = False
    try:
        sel = selectors.DefaultSelector()
        for proc, label in zip(procs, labels, strict=True):
            sel.register(proc.stdout, selectors.EVENT_READ, (label, [make() for make in filters]))
        deadline = start + timeout
        while sel.get_map():
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                timed_out = True
                break
            ready = sel.select(timeout=min(remaining, 1.0))
            if not ready:
                if all(proc.poll() is not None for proc in procs):
                    break
                continue
            for key, _ in ready:
                line = key.fileobj.readline()
                if not line:
                    sel.unregister(key.fileobj)
                    continue
                label, line_filters = key.data
                shown_lines = [line]
                for line_filter in line_filters:
                    shown_lines = [out for kept in shown_lines for out in line_filter.feed(kept)]
                for shown_line in shown_lines:
                    lines.append(label + shown_line)
                    if stream and not quiet:
                        print(label + shown_line, end="", flush=True)
    except KeyboardInterrupt:
        for proc in procs:
            _kill_group(proc)
        raise
    finally:
        for proc in procs:
            if timed_out:
                _kill_group(proc)
            proc.wait()
    seconds = time.perf_counter() - start
    returncode = next((proc.returncode for proc in procs if proc.returncode != 0), 0)

    records = read_metrics(metrics_path) if metrics_path else []
    result = RunResult(command=commands[0], returncode=returncode, output="".join(lines), seconds=seconds,
                       metrics=records)
    if timed_out:
        raise TimeoutError(f"{script} did not finish within {timeout:.0f} s and was killed")
    if result.provenance and not quiet:
        _say(describe_provenance(result.provenance))
    if check and returncode != 0:
        raise RuntimeError(f"{script} exited with status {returncode}; its output is above")
    return result, procs


def find_torchrun() -> str:
    """The torchrun that belongs to this Python (the venv's), else the first on PATH."""
    beside = Path(sys.executable).with_name("torchrun")
    found = str(beside) if beside.exists() else shutil.which("torchrun")
    if not found:
        raise FileNotFoundError(
            f"torchrun not found beside {sys.executable} or on PATH: install torch into this environment (make venv)"
        )
    return found


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
