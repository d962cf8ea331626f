"""The launcher notebooks use: it fails loudly, kills what hangs, and condenses torchrun's own noise."""

import sys
import threading
import time
from pathlib import Path

import pytest

from dtbook.launch import RunResult, launch_python, launch_torchrun, side_by_side
from dtbook.output_filters import AgentTracebackFilter
from dtbook.paths import RUNS_DIR

# --- the launcher ---------------------------------------------------------------------------

def test_launcher_raises_on_a_failed_run():
    # A backend no machine has: --backend nccl failed only without a GPU, and ran on one.
    with pytest.raises(RuntimeError, match="exited with status"):
        launch_torchrun("ch2_hello_distributed.py", ["--backend", "mpi"], nproc=1, timeout=60, quiet=True)


def test_the_shown_command_is_the_one_a_reader_types_and_stream_false_keeps_the_output(capsys):
    """Variables in front (an unset one with env -u), paths in the repository relative to it."""
    run = launch_python("ch2_hello_distributed.py", ["--help", RUNS_DIR / "ignored.jsonl"], metrics=False,
                        env={"MKL_CBWR": "AUTO,STRICT", "DTBOOK_NOT_SET": None}, stream=False, timeout=60)
    shown = capsys.readouterr().out
    assert shown.splitlines()[0] == ("$ env -u DTBOOK_NOT_SET MKL_CBWR=AUTO,STRICT python "
                                     "scripts/ch2_hello_distributed.py --help runs/ignored.jsonl")
    assert "usage:" in run.output and "usage:" not in shown  # kept, not streamed


def test_side_by_side_runs_at_once_and_returns_in_order():
    """Each call waits at a barrier for the other, so the calls must overlap to return at all."""
    def barrier_launch(timeout):
        both_started = threading.Barrier(2, timeout=timeout)

        def launch(name):
            both_started.wait()
            return name
        return launch

    assert side_by_side(barrier_launch(30), ["first", "second"]) == {"first": "first", "second": "second"}
    # The control: one call after the other, the first waits alone and the barrier breaks.
    launch = barrier_launch(0.5)
    with pytest.raises(threading.BrokenBarrierError):
        [launch(name) for name in ["first", "second"]]


def test_launches_side_by_side_keep_their_lines_whole(capsys):
    """Two launches printing at once: every printed line is one whole line of one launch."""
    runs = side_by_side(lambda script: launch_python(script, ["--help"], metrics=False, stream=False, timeout=60),
                        ["ch2_hello_distributed.py", "ch2_collectives.py"])
    assert all("usage:" in run.output for run in runs.values())
    shown = capsys.readouterr().out.splitlines()
    assert sorted(shown) == ["$ python scripts/ch2_collectives.py --help",
                             "$ python scripts/ch2_hello_distributed.py --help"]


HANGING_PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like torchrun's workers
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""


def test_launcher_kills_a_hanging_run_and_its_children(tmp_path):
    """A run past its deadline is killed with every process it started: nothing is left orphaned.

    The script starts a child as torchrun's agent starts workers, without torchrun's start-up time,
    so the deadline can be short and still never fire before the processes exist.
    """
    pid_file = tmp_path / "pids"
    hang = tmp_path / "hang.py"
    hang.write_text(HANGING_PARENT)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 8 s"):
        launch_python(str(hang), [pid_file], timeout=8, metrics=False, quiet=True)
    assert time.monotonic() - start < 8 + 10  # the deadline, plus at most SIGTERM's grace period
    assert pid_file.exists(), "the hanging script never started: raise the deadline on this machine"
    survivors = [pid for pid in map(int, pid_file.read_text().split()) if still_running(pid)]
    assert survivors == []  # gone, not orphaned


def still_running(pid: int, grace_s: float = 5.0) -> bool:
    """Whether ``pid`` is still running after a short grace. A zombie (exited, not yet reaped by
    whoever adopted it) has stopped running, so it counts as gone."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state == "Z":
            return False
        time.sleep(0.1)
    return True


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


def test_show_says_how_the_run_ended_and_prints_each_matching_line_once(capsys):
    long_line = "c x" + "y" * 20
    run = RunResult(command=[], returncode=1, output=f"a x\nb\na x\n{long_line}\n", seconds=2.04)
    run.show("x", width=10)
    assert capsys.readouterr().out.splitlines() == [
        "exit status 1 after 2.0 s, 4 lines of output", "a x", long_line[:10] + " …"]
