"""Chapter 1's scripts: bad input is one line and exit status 2, never a traceback.

The flags are checked in-process: run_main around parse_args, exactly as each script's main() runs
them, without paying a Python start-up per case (tests/ch3 runs the same contract end to end).
"""

import pytest

from dtbook.cli import ScriptError, run_main
from dtbook.distributed import start_single_device

BAD_INPUT = [
    ("memory", ["--batch-size", "0"], "--batch-size"),
    ("memory", ["--models", "huge"], "invalid choice: 'huge'"),
    ("precision", ["--steps", "10", "--scaler-steps", "20"], "--scaler-steps 20 is more than"),
    ("precision", ["--scaler-steps", "10", "--inject-inf-at", "50"], "--inject-inf-at 50 is after"),
    ("precision", ["--batch-size", "16", "--tokens-per-batch", "100"], "--tokens-per-batch"),
    ("checkpointing", ["--model", "small", "--segments", "3"], "--segments 3 is more than the 2 blocks"),
    ("checkpointing", ["--dropout", "1"], "--dropout must be in [0, 1)"),
    ("attention", ["--seq-lens", "64", "0"], "--seq-lens"),
    ("accumulation", ["--accum-steps", "1"], "--accum-steps must be at least 2"),
    ("accumulation", ["--micro-batch-size", "4", "--last-micro-batch", "4"], "--last-micro-batch (4)"),
]


@pytest.mark.parametrize("script, argv, problem", BAD_INPUT, ids=[f"{s}:{a[0]}" for s, a, _ in BAD_INPUT])
def test_bad_flags_give_one_line(request, capsys, script, argv, problem):
    module = request.getfixturevalue(script)
    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda: module.parse_args(argv))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert exit_info.value.code == 2
    assert len(errors) == 1 and problem in errors[0], err
    assert "Traceback" not in err


def test_more_than_one_process_is_refused_before_joining_a_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ScriptError, match="trains on one device, but it was started as 2 processes"):
        start_single_device("auto")
