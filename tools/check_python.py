"""Say in one line why this Python cannot make the book's venv, or nothing if it can.

    python3.X tools/check_python.py     # `make venv` runs it before `python3.X -m venv`

requirements.txt is resolved (`make lock`) and tested (tests/pipeline/test_requirements.py) for
Python OLDEST to NEWEST; an install on another Python fails halfway through, or is untested. Debian
and Ubuntu ship `venv`'s ensurepip apart from Python, in python3.X-venv: without it `python -m venv`
leaves a venv without pip behind. Exit status 1 with the line on stdout, 0 and no output otherwise.

It runs before anything is installed, on whatever Python a reader names: only syntax and modules
that Python 3.6 has.
"""

import sys

OLDEST = (3, 10)
NEWEST = (3, 13)  # torch 2.13.0 has 3.14 wheels, but the book has not run on 3.14


def supported_range() -> str:
    return f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"


def problem() -> str:
    version = ".".join(str(part) for part in sys.version_info[:3])
    this = f"Python {version} ({sys.executable})"
    minor = tuple(sys.version_info[:2])
    if not OLDEST <= minor <= NEWEST:
        return (f"the book needs Python {supported_range()}, and this is {this}: "
                f"name one of those with make venv PYTHON=python3.X")
    try:
        import ensurepip  # noqa: F401  (python -m venv installs pip with it)
    except ImportError:
        return (f"{this} has no ensurepip, which python -m venv needs to install pip: "
                f"on Debian or Ubuntu, apt-get install python{minor[0]}.{minor[1]}-venv")
    return ""


if __name__ == "__main__":
    found = problem()
    if found:
        print(found)
        sys.exit(1)
