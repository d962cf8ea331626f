"""The launcher notebooks use: it fails loudly, kills what hangs, and condenses torchrun's own noise."""

import os
import sys
import time

import pytest

from dtbook.launch import launch_torchrun
from dtbook.output_filters import AgentTracebackFilter

# --- the launcher ---------------------------------------------------------------------------

def test_launcher_raises_on_a_failed_run():
    with pytest.raises(RuntimeError, match="exited with status"):
        launch_torchrun("ch2_hello_distributed.py", ["--backend", "nccl"], nproc=1, timeout=60, quiet=True)


def test_launcher_kills_a_hanging_run(tmp_path):
    pid_file = tmp_path / "pid"
    hang = tmp_path / "hang.py"
    hang.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        launch_torchrun(str(hang), nproc=1, timeout=15, metrics=False, quiet=True)
    assert time.monotonic() - start < 40
    worker = int(pid_file.read_text())
    time.sleep(1)
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)  # the worker is gone, not orphaned


def test_launcher_reports_a_missing_torchrun(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="torchrun not found"):
        launch_torchrun("ch2_hello_distributed.py", nproc=1, quiet=True)


# --- the launcher's output filter -----------------------------------------------------------

AGENT_STACK = [
    "Traceback (most recent call last):\n",
    '  File "/venv/bin/torchrun", line 8, in <module>\n',
    "    sys.exit(main())\n",
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent\n',
    "    raise ChildFailedError(\n",
]


def filtered(lines):
    f = AgentTracebackFilter()
    return [out for line in lines for out in f.feed(line)]


def test_filter_replaces_the_agent_stack_but_keeps_the_failure_summary():
    out = filtered(["[rank 1] error: bad flag\n", *AGENT_STACK,
                    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n", "====\n", "Root Cause\n"])
    assert out[0] == "[rank 1] error: bad flag\n"
    assert "stack trace is omitted" in out[1]
    assert out[2:] == ["====\n", "Root Cause\n"]


def test_filter_keeps_a_launcher_error_that_is_not_a_worker_failure():
    error = "torch.distributed.DistNetworkError: The server socket has failed to listen (EADDRINUSE)\n"
    out = filtered([*AGENT_STACK[:3], error])
    assert out[-1] == error


def test_filter_leaves_a_workers_own_traceback_alone():
    worker = ["Traceback (most recent call last):\n", '  File "scripts/x.py", line 3, in <module>\n',
              "ValueError: the reader's bug\n"]
    assert filtered(worker) == worker
