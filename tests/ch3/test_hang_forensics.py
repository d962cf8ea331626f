"""Chapter 3, reading a hung job: the flight-recorder script's flags, its control and another world size.

Section 3.3 (notebooks/ch3_ddp/03_hangs.ipynb) runs the two-rank hang, attaches
py-spy, reads the dumps with plain Python and torchfrtrace, and asserts the divergence against a
control run that dumps at the end: none of that is launched again here. What is tested below is
what the page cannot show: one-line refusals, --help, that a run without a hang writes no dump,
that the recorder records with no buffer size set, and a hang among three ranks.
"""

import json
import pickle
from pathlib import Path

import pytest

from support import assert_inputs_checked, load_script, run_in_process, run_python, run_torchrun

SCRIPT = "ch3_hang_forensics.py"
PG_TIMEOUT = 4  # seconds: short, but with room for a slow start on busy shared cores
LIMIT = 120  # seconds any single run may take before the test fails


def recorder_env(tmp_path) -> dict:
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "rank_")}


def test_help_shows_the_usage_lines():
    done = run_python(SCRIPT, "--help", timeout=LIMIT)
    assert "torchrun --standalone --nproc_per_node=2 scripts/ch3_hang_forensics.py" in done.output
    assert "--extra-on-rank" in done.output and "--dump-at-end" in done.output


@pytest.mark.parametrize(("name", "size"), [("TORCH_FR_BUFFER_SIZE", "0"),
                                           ("TORCH_FR_BUFFER_SIZE", "2k"),
                                           ("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")])
def test_a_buffer_size_that_turns_the_recorder_off_is_refused(monkeypatch, capsys, name, size):
    for other in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, size)
    assert run_in_process(SCRIPT, monkeypatch=monkeypatch) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {name}={size!r} turns the flight recorder off")


def test_unset_the_recorder_keeps_torchs_default(tmp_path):
    """torch 2.13's FlightRecorder defaults to 2000 entries, gloo included: a control run with
    no buffer size set still dumps every collective it issued."""
    env = {"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "rank_"),
           "TORCH_FR_BUFFER_SIZE": None, "TORCH_NCCL_TRACE_BUFFER_SIZE": None}
    import torch

    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/FlightRecorder.hpp"
    assert '{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000);' in header.read_text()
    run_torchrun(SCRIPT, "--dump-at-end", "--steps", 3, "--timeout", PG_TIMEOUT, env=env,
                 timeout=LIMIT)
    dumps = [pickle.loads((tmp_path / f"rank_{r}").read_bytes()) for r in range(2)]
    for dump in dumps:
        names = [e["profiling_name"] for e in dump["entries"]]
        assert names.count("gloo:all_reduce") == 3 and names[-1] == "gloo:barrier", names


@pytest.mark.parametrize(
    ("extra_on_rank", "world", "problem"),
    [
        (None, 1, None),  # the control runs in a world of one too
        (0, 1, "needs at least 2 processes"),
        (2, 2, "--extra-on-rank 2 is not a rank of this world of 2"),
        (-1, 2, "--extra-on-rank -1 is not a rank"),
        (1, 2, None),
    ],
)
def test_extra_on_rank_is_checked(monkeypatch, extra_on_rank, world, problem):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    program = load_script(SCRIPT)
    args = program.argparse.Namespace(extra_on_rank=extra_on_rank)
    assert_inputs_checked(program, args, world, problem)


def test_a_zero_timeout_is_refused_by_argparse():
    done = run_python(SCRIPT, "--timeout", "0", check=False, timeout=LIMIT,
                      env={"TORCH_FR_BUFFER_SIZE": "2000"})
    assert done.returncode == 2
    assert "error: argument --timeout" in done.output.splitlines()[-1]
    assert "Traceback" not in done.output


def test_a_run_without_a_hang_writes_no_dump(tmp_path):
    """No timeout fired, no --dump-at-end: the prefix stays empty."""
    run_torchrun(SCRIPT, "--timeout", PG_TIMEOUT, env=recorder_env(tmp_path), timeout=LIMIT)
    assert list(tmp_path.glob("rank_*")) == []


def test_three_ranks_one_extra_collective(tmp_path):
    """The last rank goes its own way: every rank dumps and fails with one line, and the
    dumps differ only in that rank's last collective."""
    done = run_torchrun(SCRIPT, "--extra-on-rank", 2, "--timeout", PG_TIMEOUT, nproc=3,
                        env=recorder_env(tmp_path), timeout=LIMIT, check=False)
    assert done.returncode != 0
    errors = [line for line in done.output.splitlines() if "error:" in line]
    assert sorted(line.split("]")[0] for line in errors) == ["[rank 0", "[rank 1", "[rank 2"]
    assert all("flight-recorder dump in" in line for line in errors)
    dumps = [pickle.loads((tmp_path / f"rank_{r}").read_bytes()) for r in range(3)]
    last = [d["entries"][-1] for d in dumps]
    assert [e["profiling_name"] for e in last] == ["gloo:barrier"] * 2 + ["gloo:all_reduce"]
    assert len({e["collective_seq_id"] for e in last}) == 1
    before = [[(e["profiling_name"], e["input_sizes"]) for e in d["entries"][:-1]] for d in dumps]
    assert before[0] == before[1] == before[2]


def test_the_ranks_name_py_spy_as_a_tracer_where_yama_exists():
    """prctl(PR_SET_PTRACER) is Yama's: it succeeds where Yama is loaded, and the kernel answers
    EINVAL without it. Where Yama is missing (this suite's machine so far) this shows only that
    the call reaches prctl and reports its errno; where Yama runs, that the call is well formed."""
    import errno

    result = load_script(SCRIPT).allow_py_spy()
    yama = Path("/proc/sys/kernel/yama/ptrace_scope").exists()
    assert result == (0 if yama else errno.EINVAL)


class _LibcWithoutPrctl:
    """A C library as macOS's looks to ctypes: no prctl symbol."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        raise AttributeError(f"dlsym(RTLD_DEFAULT, {name}): symbol not found")


# Runs the script as torchrun would, on a pretend macOS: sys.platform says darwin and the C
# library has no prctl. torch and the book's library are imported first, on the real platform.
WITHOUT_PRCTL = """
import ctypes, runpy, sys
import torch, torch.distributed, dtbook.cli, dtbook.distributed
sys.platform = "darwin"
class NoPrctl:
    def __init__(self, *args, **kwargs):
        pass
    def __getattr__(self, name):
        raise AttributeError(f"dlsym(RTLD_DEFAULT, {name}): symbol not found")
ctypes.CDLL = NoPrctl
sys.argv = sys.argv[1:]  # the script's own path, then its arguments
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_without_prctl_allow_py_spy_calls_nothing_and_says_why(monkeypatch):
    program = load_script(SCRIPT)
    monkeypatch.setattr(program.ctypes, "CDLL", _LibcWithoutPrctl)
    with pytest.raises(AttributeError):  # what the old unconditional call met on macOS
        _ = program.ctypes.CDLL(None).prctl
    monkeypatch.setattr(program.sys, "platform", "darwin")
    reason = program.allow_py_spy()
    assert reason == "no prctl on darwin: nothing to allow, py-spy needs root here"


def test_without_prctl_the_script_still_hangs_and_dumps(tmp_path):
    """On a pretend macOS the ranks record their pids and the reason, hang, write their
    flight-recorder dumps and fail with one line each, as on Linux."""
    from support import SCRIPTS

    wrapper = tmp_path / "without_prctl.py"
    wrapper.write_text(WITHOUT_PRCTL)
    metrics = tmp_path / "metrics.jsonl"
    done = run_torchrun(wrapper, SCRIPTS / SCRIPT, "--extra-on-rank", 0, "--timeout", PG_TIMEOUT,
                        "--metrics", metrics, env=recorder_env(tmp_path), timeout=LIMIT,
                        check=False)
    assert done.returncode != 0 and "Traceback" not in done.output, done.output
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (pids,) = [r for r in records if r.get("event") == "pids"]
    assert pids["ptracer"].startswith("no prctl on darwin"), pids
    errors = [line for line in done.output.splitlines() if "error:" in line]
    assert len(errors) == 2 and all("flight-recorder dump in" in e for e in errors), done.output
    dumps = [pickle.loads((tmp_path / f"rank_{r}").read_bytes()) for r in range(2)]
    last = [d["entries"][-1]["profiling_name"] for d in dumps]
    assert last == ["gloo:all_reduce", "gloo:barrier"]
