"""Chapter 3, debugging: each reproduced failure fails fast, with the message that names it, and its fix works.

Every failing run is bounded twice: by the script's process-group timeout (--timeout) and by the
subprocess timeout here, so a regression that turns an error back into a hang fails the test instead
of stalling the suite.

The book's runs of notebooks/ch3_ddp/03_hangs.ipynb (mismatched collectives with and without
DETAIL and the fixed version, the monitored barrier, uneven inputs and join) and
notebooks/ch3_ddp/04_silent_failures.ipynb (unused parameters with find_unused_parameters and
static_graph, the benchmark of the three settings, DDP under DETAIL, the rank-seed runs, the bad
record, the busy port) assert every failure they show and every fix: none of those is launched
again here. What is tested below is what the page cannot show: the script's flag checks.
"""

import pytest

from support import run_python

SCRIPT = "ch3_failures.py"
PG_TIMEOUT = 4  # seconds: short, but with room for a slow start on busy shared cores
LIMIT = 90  # seconds any single run may take before the test fails


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--failure", "rank-seed", "--fixed"], "--fixed applies only to --failure mismatched-collective"),
        (["--failure", "uneven-inputs", "--barrier-timeout", "1"],
         "--barrier-timeout applies only to --failure stuck-rank"),
        (["--failure", "unused-parameter", "--find-unused-parameters", "--static-graph"],
         "choose one of --find-unused-parameters and --static-graph"),
        (["--failure", "mismatched-collective"], "needs at least 2 processes"),
        (["--failure", "uneven-inputs"], "needs at least 2 processes"),
        (["--failure", "bad-record", "--join"], "--join applies only to --failure uneven-inputs"),
        (["--failure", "rank-seed", "--all-variants", "--ddp"], "--all-variants runs every --model-seed"),
        (["--failure", "unused-parameter", "--both-fixes", "--static-graph"], "--both-fixes runs"),
        (["--failure", "rank-seed", "--both-fixes"], "--both-fixes applies only to --failure unused-parameter"),
        (["--failure", "rank-seed", "--ddp-own-group"],
         "--ddp-own-group applies only to --failure ddp-under-detail"),
    ],
)
def test_bad_flags_give_one_line(args, message):
    done = run_python(SCRIPT, *args, check=False, timeout=LIMIT)
    assert done.returncode == 2
    lines = done.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_a_zero_timeout_is_refused_by_argparse():
    done = run_python(SCRIPT, "--timeout", "0", check=False, timeout=LIMIT)
    assert done.returncode == 2
    assert "error: argument" in done.output.splitlines()[-1]
    assert "Traceback" not in done.output
