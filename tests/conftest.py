import os
import signal
import subprocess
import sys
import time

import pytest

from support import REPO

BOOK_BUILD = REPO / "_build" / "book"  # the folder `make book` builds: the tests check that book
BUILD_TIMEOUT_S = 3000
_BUILD: dict = {}  # the one build of this session, so a failure is not rebuilt for every test


def pytest_configure(config):
    """Refuse, in one line, a torch other than the one requirements.txt pins.

    The scripts use the API of that version: on an H100 with torch 2.11, the suite failed where
    a script called ``dist.all_gather_single`` (new in 2.13; 2.11 has all_gather_into_tensor).
    A CUDA build of the pinned version ("2.13.0+cu130") is the same torch.
    """
    import re

    import torch

    pinned = re.search(r"^torch==(\S+)$", (REPO / "requirements.txt").read_text(), re.M).group(1)
    if torch.__version__.split("+")[0] != pinned:
        raise pytest.UsageError(f"the tests need torch {pinned} (requirements.txt), this is "
                                f"{torch.__version__}: run them with make test, in .venv")


def pytest_collection_modifyitems(session, config, items):
    """Tests that need the built book run last, in their order: on a fresh clone every other test
    (the pins resolved for each Python, the ordinary user's lab) runs while the book builds."""
    items.sort(key=lambda item: "book" in getattr(item, "fixturenames", ()))


def pytest_collection_finish(session):
    """Bring the book up to date as soon as the session knows it needs it.

    It is the book `make book` builds, with the same parameters and fingerprints: after
    `make book` nothing is executed again; on a fresh clone every notebook runs. The build
    runs in the background while the chapter tests run, two notebooks side by side: both
    spend much of their time waiting (process start-up, rendezvous, the timeouts they
    demonstrate), so together they keep two cores busier than one after the other.
    """
    if any("book" in getattr(item, "fixturenames", ()) for item in session.items):
        BOOK_BUILD.parent.mkdir(parents=True, exist_ok=True)
        out = open(BOOK_BUILD.parent / "book-build.out", "w")
        err = open(BOOK_BUILD.parent / "book-build.err", "w")
        _BUILD["started"] = time.monotonic()
        _BUILD["files"] = (out, err)
        _BUILD["process"] = subprocess.Popen(
            [sys.executable, str(REPO / "tools" / "build_book.py"), "--out", str(BOOK_BUILD), "--jobs", "2"],
            stdout=out, stderr=err, cwd=REPO, start_new_session=True)


def pytest_sessionfinish(session):
    """A session that ends early (-x, Ctrl-C) stops the build and every kernel it started."""
    process = _BUILD.get("process")
    if process is not None and process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def book():
    """The book as `make book` builds it: every notebook executed, the HTML built.

    Unchanged notebooks are not executed again (the builder fingerprints them), so after
    `make book`, or a second `make test`, only the tests cost time. A failed build is
    reported once and not retried by every test that needs it.
    """
    process = _BUILD["process"]
    if "returncode" not in _BUILD:
        left = BUILD_TIMEOUT_S - (time.monotonic() - _BUILD["started"])
        try:
            _BUILD["returncode"] = process.wait(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _BUILD["returncode"] = f"killed after {BUILD_TIMEOUT_S} s"
        for file in _BUILD["files"]:
            file.close()
        stdout = (BOOK_BUILD.parent / "book-build.out").read_text()
        print(stdout[-3000:])
    if _BUILD["returncode"] != 0:
        out, err = ((BOOK_BUILD.parent / f"book-build.{kind}").read_text()[-4000:] for kind in ("err", "out"))
        pytest.fail(f"building the book failed ({_BUILD['returncode']}):\n{out}\n{err}", pytrace=False)
    return BOOK_BUILD
