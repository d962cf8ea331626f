import subprocess
import sys

import pytest

from support import REPO

QUICK_BUILD = REPO / "_build" / "quick"
_BUILD: dict = {}  # the one build of this session, kept so a failure is not rebuilt for every test


@pytest.fixture(scope="session")
def quick_book():
    """Execute every notebook with QUICK=True and build the HTML once per test session.

    Two notebooks run side by side: much of each one's time is waiting (process start-up,
    rendezvous, the timeouts it demonstrates), and the test build's numbers are never shown.

    Unchanged notebooks are not re-executed (the builder fingerprints them), so a
    second `make test` is quick; a clean clone executes everything. A failed build is
    reported once and not retried by every test that needs it.
    """
    if "done" not in _BUILD:
        _BUILD["done"] = subprocess.run(
            [sys.executable, str(REPO / "tools" / "build_book.py"), "--quick", "--out", str(QUICK_BUILD),
             "--jobs", "2"],
            capture_output=True, text=True, cwd=REPO, timeout=2400,
        )
        print(_BUILD["done"].stdout[-3000:])
    done = _BUILD["done"]
    if done.returncode != 0:
        pytest.fail(f"building the book failed:\n{done.stderr[-4000:]}\n{done.stdout[-4000:]}", pytrace=False)
    return QUICK_BUILD
