import subprocess
import sys

import pytest

from support import REPO

QUICK_BUILD = REPO / "_build" / "quick"


@pytest.fixture(scope="session")
def quick_book():
    """Execute every notebook with QUICK=True and build the HTML once per test session.

    Unchanged notebooks are not re-executed (the builder fingerprints them), so a
    second `make test` is quick; a clean clone executes everything.
    """
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "build_book.py"), "--quick", "--out", str(QUICK_BUILD)],
        capture_output=True, text=True, cwd=REPO, timeout=1500,
    )
    if done.returncode != 0:
        pytest.fail(f"building the book failed:\n{done.stderr[-4000:]}\n{done.stdout[-4000:]}", pytrace=False)
    print(done.stdout[-3000:])
    return QUICK_BUILD
