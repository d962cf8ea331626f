"""Plumbing shared by the book's companion scripts and notebooks.

Everything here is deliberately boring: choosing a backend and device, a
deterministic synthetic corpus, a small GPT-style model, writing metrics as JSON
lines, one-line errors, and the launcher that notebooks use to run a script
under torchrun. The distributed logic itself lives in the scripts, where a
reader can see it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

SCRIPTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCRIPTS_DIR.parent
RUNS_DIR = REPO_ROOT / "runs"  # scratch space for run artefacts (git-ignored)


# --------------------------------------------------------------------------
# Errors a reader can act on
# --------------------------------------------------------------------------


class ScriptError(Exception):
    """A problem with the inputs or environment, reported as one line."""


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
        print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


def positive_int(text: str) -> int:
    """argparse type for sizes and counts that must be at least 1."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type for rates and sizes that must be greater than zero."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number greater than 0, got {text}")
    return value


# --------------------------------------------------------------------------
# Backend and device
# --------------------------------------------------------------------------


def choose_backend(requested: str = "auto") -> tuple[str, torch.device]:
    """Pick the process-group backend and this process's device.

    ``auto`` means NCCL with one GPU per local rank when there are enough GPUs,
    otherwise gloo on the CPU; gloo always computes on the CPU here. Asking for ``nccl`` without enough GPUs is an
    error rather than a silent fallback: a run that says nccl must be nccl.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    enough_gpus = gpus >= local_world_size

    if requested not in ("auto", "gloo", "nccl"):
        raise ScriptError(f"unknown backend {requested!r}: choose auto, gloo or nccl")
    if requested == "nccl" and not enough_gpus:
        raise ScriptError(
            f"--backend nccl needs one CUDA GPU per local process: {local_world_size} "
            f"process(es) on this node, {gpus} GPU(s) visible. Use --backend gloo (or auto) on CPU."
        )
    backend = requested if requested != "auto" else ("nccl" if gpus and enough_gpus else "gloo")
    if backend == "gloo":
        return backend, torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return backend, device


def use_single_process_defaults() -> None:
    """Let ``python script.py`` (no launcher) run as a world of one.

    torchrun sets these variables; without it we fill in the same ones so the
    script's ``init_process_group`` call works unchanged.
    """
    if "RANK" in os.environ:
        return
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )


def free_port() -> int:
    """A TCP port on localhost that nothing is listening on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def device_name(device: torch.device) -> str:
    """A human-readable name of the hardware a number came from."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(backend: str, world_size: int, device: torch.device) -> dict:
    """Where a run's numbers came from, recorded beside the numbers."""
    return {
        "event": "provenance",
        "backend": backend,
        "world_size": world_size,
        "device": device.type,
        "device_name": device_name(device),
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


# --------------------------------------------------------------------------
# Metrics as JSON lines
# --------------------------------------------------------------------------


class MetricsWriter:
    """Append one JSON object per line; a no-op on ranks other than 0 or without a path."""

    def __init__(self, path: str | None, enabled: bool = True):
        self.file = None
        if path and enabled:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)

    def write(self, **record) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------
# Synthetic data and a small GPT
# --------------------------------------------------------------------------


def synthetic_corpus(num_tokens: int, vocab_size: int, seed: int) -> torch.Tensor:
    """A deterministic token stream with structure a small model can learn.

    Tokens come from a random sparse Markov chain: each token has a handful of
    likely successors. The entropy is well below log(vocab_size), so the loss
    has somewhere to fall, and the same seed always gives the same corpus on
    every rank and every machine (we draw on the CPU with our own generator).
    """
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=gen)
    weights = torch.tensor([0.55, 0.25, 0.15, 0.05])
    choices = torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    table, picks = successors.tolist(), choices.tolist()
    tokens = [0] * num_tokens
    for i in range(1, num_tokens):
        tokens[i] = table[tokens[i - 1]][picks[i]]
    return torch.tensor(tokens, dtype=torch.long)


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping (input, target) windows of ``context`` tokens."""

    def __init__(self, tokens: torch.Tensor, context: int):
        self.tokens = tokens
        self.context = context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, i: int):
        start = i * self.context
        chunk = self.tokens[start : start + self.context + 1]
        return chunk[:-1], chunk[1:]


@dataclass
class GPTConfig:
    vocab_size: int = 256
    context: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0


MODEL_SIZES = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32),
    "small": GPTConfig(n_layer=2, n_head=4, n_embd=64),
    "medium": GPTConfig(n_layer=4, n_head=4, n_embd=128),
    "large": GPTConfig(n_layer=6, n_head=8, n_embd=256),
}


class Block(nn.Module):
    """One pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """A small GPT: token + position embeddings, a stack of blocks, a tied head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.context, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        # GPT-2's initialization. PyTorch's default N(0, 1) embedding, tied to the output head, would
        # make the first logits huge and the first loss several times log(vocab_size).
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# --------------------------------------------------------------------------
# Launching a script under torchrun from a notebook
# --------------------------------------------------------------------------


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


def describe_provenance(prov: dict) -> str:
    return (
        f"ran on: {prov['backend']} · {prov['world_size']} process(es) · "
        f"{prov['device']} ({prov['device_name']}, {prov['cpu_cores']} cores) · torch {prov['torch']}"
    )


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
) -> RunResult:
    """Run ``scripts/<script>`` under torchrun, streaming its output.

    Prints the exact command first, so a reader can paste it into a terminal.
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
        print("$ " + _shown_command(["torchrun", *torchrun_args], script_path, args, metrics_path), flush=True)

    cores = os.cpu_count() or 1
    run_env = _child_env(env, threads_per_process or max(1, cores // max(1, nproc)))
    result, _ = _run_commands(script, [command], [""], metrics_path, timeout, check, run_env, quiet)
    return result


@dataclass
class NodesRunResult(RunResult):
    """A run made of several torchrun agents, one per pretend node."""

    commands: list[list[str]] = field(default_factory=list)  # commands[i] started node i's agent
    agent_pids: list[int] = field(default_factory=list)  # agent_pids[i]: process id of node i's agent


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
) -> NodesRunResult:
    """Play ``nnodes`` machines on this one: start one torchrun agent per "node".

    Agent i gets ``--nnodes=N --node_rank=i --nproc_per_node=P`` and all agents
    meet at one rendezvous on 127.0.0.1, as agents on separate hosts meet at the
    first host's address. ``rdzv_backend="c10d"`` passes ``--rdzv-backend=c10d
    --rdzv-endpoint --rdzv-id`` (the rendezvous then assigns node ranks itself);
    ``"static"`` passes ``--master-addr/--master-port`` (``--node_rank`` is
    honored). Output lines are prefixed with their node; metrics, streaming,
    the timeout and clean-up work as in ``launch_torchrun``, for every agent.
    """
    if rdzv_backend not in ("c10d", "static"):
        raise ValueError(f"rdzv_backend must be 'c10d' or 'static', got {rdzv_backend!r}")
    script_path = _script_path(script)
    launcher = [find_torchrun()]
    args, metrics_path = _script_args(script_path, args, metrics)
    port = free_port()
    if rdzv_backend == "c10d":
        meeting = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=book-{port}"]
    else:
        meeting = ["--master-addr=127.0.0.1", f"--master-port={port}"]
    per_node = [[f"--nnodes={nnodes}", f"--node_rank={node}", f"--nproc_per_node={nproc_per_node}", *meeting]
                for node in range(nnodes)]
    commands = [[*launcher, *torchrun_args, str(script_path), *args] for torchrun_args in per_node]
    if not quiet:
        for node, torchrun_args in enumerate(per_node):
            shown = _shown_command(["torchrun", *torchrun_args], script_path, args, metrics_path)
            print(f"$ {shown}   # node {node}", flush=True)

    cores = os.cpu_count() or 1
    run_env = _child_env(env, threads_per_process or max(1, cores // max(1, nnodes * nproc_per_node)))
    labels = [f"[node {node}] " for node in range(nnodes)]
    result, pids = _run_commands(script, commands, labels, metrics_path, timeout, check, run_env, quiet,
                                 filters=(AgentTracebackFilter, ExitBarrierRaceFilter))
    return NodesRunResult(**vars(result), commands=commands, agent_pids=pids)


def launch_python(
    script: str,
    args: list[str] | tuple[str, ...] = (),
    timeout: float = 300,
    metrics: bool = True,
    check: bool = True,
    env: dict | None = None,
    threads_per_process: int | None = None,
    quiet: bool = False,
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
        print("$ " + _shown_command(["python"], script_path, args, metrics_path), flush=True)
    run_env = _child_env(env, threads_per_process)
    result, _ = _run_commands(script, [command], [""], metrics_path, timeout, check, run_env, quiet)
    return result


def _script_path(script: str) -> Path:
    script_path = SCRIPTS_DIR / script
    if not script_path.exists():
        raise FileNotFoundError(f"no companion script {script_path}")
    return script_path


def _script_args(script_path: Path, args, metrics: bool) -> tuple[list[str], str | None]:
    """The script's arguments as strings, plus ``--metrics`` and a fresh file under runs/ when asked."""
    args = [str(a) for a in args]
    metrics_path = None
    if metrics:
        RUNS_DIR.mkdir(exist_ok=True)
        fd, metrics_path = tempfile.mkstemp(prefix=f"{script_path.stem}-", suffix=".jsonl", dir=RUNS_DIR)
        os.close(fd)
        args += ["--metrics", metrics_path]
    return args, metrics_path


def _shown_command(launcher: list[str], script_path: Path, args: list[str], metrics_path: str | None) -> str:
    """The command as a reader would type it in the repository root."""
    shown = [*launcher, os.path.relpath(script_path, REPO_ROOT),
             *[os.path.relpath(a, REPO_ROOT) if a == metrics_path else a for a in args]]
    return shlex.join(shown)


def _child_env(env: dict | None, threads: int | None) -> dict:
    run_env = {**os.environ, **(env or {})}
    if threads is not None:
        run_env.setdefault("OMP_NUM_THREADS", str(threads))
    run_env["PYTHONUNBUFFERED"] = "1"
    return run_env


def _run_commands(script, commands, labels, metrics_path, timeout, check, run_env, quiet,
                  filters=None) -> tuple[RunResult, list]:
    """Start each command in its own process group, stream their output, enforce one deadline.

    Each process's output passes through fresh instances of ``filters`` (classes), in
    order; the default is ``AgentTracebackFilter`` alone.
    Returns the result and the process ids. On a timeout or an interrupt every
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
                    if not quiet:
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
        print(describe_provenance(result.provenance))
    if check and returncode != 0:
        raise RuntimeError(f"{script} exited with status {returncode}; its output is above")
    return result, [proc.pid for proc in procs]


class AgentTracebackFilter:
    """Drop the torchrun agent's own Python traceback when a worker fails.

    When any worker exits non-zero, torchrun raises ChildFailedError and prints
    a dozen lines of its *own* call stack before the useful failure summary.
    That stack says nothing about the reader's program and buries the worker's
    one-line error, so it is replaced by one line; workers' output is untouched.
    """

    def __init__(self):
        self.pending: str | None = None
        self.skipping = False

    def feed(self, line: str) -> list[str]:
        if self.skipping:
            if line.startswith(" "):  # still inside the stack
                return []
            self.skipping = False  # the exception line ends the stack
            if "ChildFailedError:" in line:
                return ["torchrun: a worker failed (the launcher's own stack trace is omitted); summary:\n"]
            return ["torchrun failed (its own stack trace is omitted):\n", line]
        if self.pending is not None:
            pending, self.pending = self.pending, None
            if "torchrun" in line or "torch/distributed/run.py" in line:
                self.skipping = True
                return []
            return [pending, line]
        if line.startswith("Traceback (most recent call last):"):
            self.pending = line
            return []
        return [line]


class ExitBarrierRaceFilter:
    """Condense torchrun's report of a known, harmless race at the end of a multi-agent run.

    After their workers finish, the agents of a multi-node job meet at an exit
    barrier held in the store of the agent that hosts it. If the host sets the
    last key and exits at once, another agent still waiting on the closed store
    logs a C++ stack and an "Error waiting on exit barrier" traceback, then
    exits normally (PyTorch issue 69520). The report is replaced by one line.
    """

    SUMMARY = ("torchrun: this agent lost the known exit-barrier race with the agent hosting the store "
               "(harmless; PyTorch issue 69520); its report is omitted\n")

    def __init__(self):
        self.held: list[str] = []  # a store warning that may turn out to be the start of the report
        self.in_report = False

    def feed(self, line: str) -> list[str]:
        if "Error waiting on exit barrier" in line:
            self.held, self.in_report = [], True
            return [self.SUMMARY]
        if self.in_report:
            if "elastic/agent/server/api.py:" in line:  # the logged traceback, one prefixed line at a time
                return []
            self.in_report = False
        if "TCPStore.cpp" in line and "recvValueWithTimeout failed" in line:
            self.held = [line]
            return []
        if self.held:
            if line.startswith(("Exception raised from", "frame #", "<omitting python frames>")) or not line.strip():
                self.held.append(line)
                return []
            held, self.held = self.held, []
            return [*held, line]
        return [line]


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
