"""requirements.txt installs on every Python the book supports; make venv refuses the others in one line.

pip resolves the lock for each Python without installing anything: `pip install --dry-run
--only-binary=:all: --python-version X`, from PyPI (--isolated: this machine's pip configuration,
with its local wheels, is not a reader's). --python-version moves Requires-Python and the wheel tags
to X, but pip evaluates environment markers for the Python it runs on, so the test picks X's lines
of the lock itself (packaging.markers) and has pip check each of them (--no-deps). The dependencies
are then walked in the metadata pip reported, with X's markers: every one must be pinned, at a version
that satisfies it, and every pin must be needed.

On an index without PEP 658 metadata pip downloads each wheel it checks, torch's too, so a wheel that
pip found for one Python is not checked again for another that the same wheel fits (its tags and its
Requires-Python): the Pythons of one minor version cost only the pins where they differ.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from packaging import tags
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

import check_python
from support import REPO

LOCK = (REPO / "requirements.txt").read_text()
TOP_LEVEL = (REPO / "requirements.in").read_text()
MAKEFILE = (REPO / "Makefile").read_text()
PIP_TIMEOUT_S = 600


def make_variable(name: str) -> str:
    """A `NAME := ...` assignment of the Makefile, continuation lines joined."""
    found = re.search(rf"^{name}\s*:=((?:.*\\\n)*.*)$", MAKEFILE, re.M)
    assert found, f"no {name} := in the Makefile"
    return " ".join(found.group(1).replace("\\\n", " ").split())


# torch's CUDA libraries, which `make lock` leaves out of the lock (the Makefile says why).
OMITTED = frozenset(canonicalize_name(name) for name in make_variable("CUDA_PACKAGES").split())


def lock_boundaries(text: str) -> set[str]:
    """The Python versions where the lock's markers switch a pin: "3.11" -> "3.11.0"."""
    found = re.findall(r"python(?:_full)?_version\s*[<>=!~]+\s*'([\d.]+)'", text)
    return {".".join((v.split(".") + ["0", "0"])[:3]) for v in found}


def pythons_to_check() -> list[str]:
    """Each supported minor version's first release (the strictest for a Requires-Python), every
    version where the lock's markers switch, Debian 12's python3 (3.11.2), and 3.11.7, which builds
    the book."""
    oldest, newest = check_python.OLDEST, check_python.NEWEST
    versions = {f"3.{minor}.0" for minor in range(oldest[1], newest[1] + 1)} | {"3.11.2", "3.11.7"}
    versions |= {v for v in lock_boundaries(LOCK) if oldest <= Version(v).release[:2] <= newest}
    return sorted(versions, key=Version)


PYTHONS = pythons_to_check()


def environment(version: str) -> dict[str, str]:
    """This machine's marker environment, on CPython `version`."""
    return default_environment() | {"python_version": ".".join(version.split(".")[:2]),
                                    "python_full_version": version, "implementation_version": version}


def lines_for(text: str, version: str) -> list[Requirement]:
    """The requirement lines of a requirements file whose markers hold on `version`."""
    env = environment(version) | {"extra": ""}
    lines = [Requirement(line.split("#", 1)[0]) for line in text.splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    return [line for line in lines if line.marker is None or line.marker.evaluate(env)]


def pins_for(version: str, text: str = LOCK) -> dict[str, Version]:
    pins = {}
    for line in lines_for(text, version):
        (spec,) = line.specifier
        assert spec.operator == "==", f"the lock pins every package with ==: {line}"
        name = canonicalize_name(line.name)
        assert name not in pins, f"two lines pin {name} on Python {version}: their markers overlap"
        pins[name] = Version(spec.version)
    return pins


@dataclass(frozen=True)
class Wheel:
    """What pip reported for one pin: the wheel it chose and that wheel's metadata."""

    filename: str
    requires_python: str
    requires_dist: tuple[str, ...]


@cache
def wheel_tags(version: str) -> frozenset:
    """The tags pip accepts for --python-version (on this machine's platform)."""
    minor = tuple(int(part) for part in version.split(".")[:2])
    return frozenset(tags.cpython_tags(minor)) | frozenset(tags.compatible_tags(minor))


def fits(wheel: Wheel, version: str) -> bool:
    """Whether pip would accept this wheel on `version`: its tags and its Requires-Python."""
    if not parse_wheel_filename(wheel.filename)[3] & wheel_tags(version):
        return False
    return SpecifierSet(wheel.requires_python).contains(version, prereleases=True)


@dataclass
class PipRun:
    version: str
    returncode: int
    output: str
    wheels: dict  # (name, Version) -> Wheel


def pip_dry_run(version: str, pins: dict[str, Version], folder: Path) -> PipRun:
    """`pip install --dry-run` of these pins on Python `version`, each pin alone (--no-deps)."""
    if not pins:
        return PipRun(version, 0, "", {})
    lock = folder / f"pins-{version}.txt"
    lock.write_text("".join(f"{name}=={pinned}\n" for name, pinned in sorted(pins.items())))
    report = folder / f"report-{version}.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--isolated", "--disable-pip-version-check", "--no-input",
         "--dry-run", "--ignore-installed", "--no-deps", "--only-binary=:all:", "--python-version", version,
         "--quiet", "--report", str(report), "-r", str(lock)],
        capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    wheels = {}
    if done.returncode == 0:
        for item in json.loads(report.read_text())["install"]:
            meta = item["metadata"]
            wheels[canonicalize_name(meta["name"]), Version(meta["version"])] = Wheel(
                item["download_info"]["url"].rsplit("/", 1)[1], meta.get("requires_python", ""),
                tuple(meta.get("requires_dist", ())))
    return PipRun(version, done.returncode, done.stdout + done.stderr, wheels)


def waves(versions: list[str]) -> list[list[str]]:
    """The first Python, then the first of every other minor version, then the rest: each wave's runs
    go side by side, and a later wave checks only what the earlier ones have not."""
    first, *rest = versions
    minors_seen = {Version(first).release[:2]}
    second = []
    for version in rest:
        if Version(version).release[:2] not in minors_seen:
            minors_seen.add(Version(version).release[:2])
            second.append(version)
    return [w for w in ([first], second, [v for v in rest if v not in second]) if w]


@dataclass
class Checked:
    """One Python's check: pip's runs that it needed, and the wheels known for its pins."""

    version: str
    pins: dict
    runs: list
    wheels: dict


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict[str, Checked]:
    folder = tmp_path_factory.mktemp("pip")
    known: dict = {}  # (name, Version) -> Wheel, from every run so far
    result = {}
    for wave in waves(PYTHONS):
        todo = {}
        for version in wave:
            pins = pins_for(version)
            unproven = {name: pinned for name, pinned in pins.items()
                        if not ((name, pinned) in known and fits(known[name, pinned], version))}
            result[version] = Checked(version, pins, [], known)
            todo[version] = unproven
        with ThreadPoolExecutor(len(wave)) as pool:
            runs = list(pool.map(pip_dry_run, wave, [todo[v] for v in wave], [folder] * len(wave)))
        for run in runs:
            result[run.version].runs.append(run)
            known.update(run.wheels)
    return result


@pytest.mark.parametrize("version", PYTHONS)
def test_pip_installs_the_lock(version, checked):
    for run in checked[version].runs:
        errors = [line for line in run.output.splitlines() if "ERROR" in line or "Requires-Python" in line]
        assert run.returncode == 0, f"pip refuses requirements.txt on Python {version}:\n" + "\n".join(errors)


def applies(requirement: Requirement, env: dict, extras) -> bool:
    return requirement.marker is None or any(requirement.marker.evaluate(env | {"extra": e}) for e in extras)


def walk(version: str, pins: dict, wheels: dict, top_level: str = TOP_LEVEL) -> tuple[list[str], list[str]]:
    """From requirements.in through the reported metadata with `version`'s markers: the dependencies
    the lock does not satisfy, and the pins that nothing needs."""
    env = environment(version)
    problems, extras_seen = [], {}
    todo = [(line, "requirements.in") for line in lines_for(top_level, version)]
    while todo:
        requirement, needed_by = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in OMITTED:
            if needed_by != "torch" and needed_by not in OMITTED:
                problems.append(f"{needed_by} needs {requirement}, which make lock leaves out (CUDA_PACKAGES)")
            continue
        if name not in pins:
            problems.append(f"{needed_by} needs {requirement}: the lock pins no {name} for Python {version}")
            continue
        if not requirement.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{needed_by} needs {requirement}: the lock pins {name}=={pins[name]}")
            continue
        new = ({""} | set(requirement.extras)) - extras_seen.get(name, set())
        if not new:
            continue
        extras_seen.setdefault(name, set()).update(new)
        wheel = wheels.get((name, pins[name]))
        if wheel is None:
            problems.append(f"pip reported no metadata for {name}=={pins[name]}")
            continue
        todo += [(dependency, name) for dependency in map(Requirement, wheel.requires_dist)
                 if applies(dependency, env, new)]
    return problems, sorted(set(pins) - set(extras_seen))


@pytest.mark.parametrize("version", PYTHONS)
def test_the_lock_pins_every_dependency_and_nothing_else(version, checked):
    check = checked[version]
    if any(run.returncode for run in check.runs):
        pytest.skip("pip refused the lock (test_pip_installs_the_lock says why)")
    unmet, needless = walk(version, check.pins, check.wheels)
    assert unmet == [], f"on Python {version}:\n" + "\n".join(unmet)
    assert needless == [], f"the lock pins what nothing needs on Python {version}: {needless}"


# Releases that the pip freeze of Python 3.11.7 pinned, which a newer Python than this one needs:
# contourpy 1.3.3 has wheels for 3.11 and newer only, soupsieve 4.1.3 requires Python 3.11.5.
REFUSED = [("3.10.0", "contourpy", "1.3.3"), ("3.11.2", "soupsieve", "4.1.3")]


@pytest.mark.parametrize(("version", "name", "release"), REFUSED)
def test_pip_refuses_a_pin_that_needs_a_newer_python(version, name, release, tmp_path):
    """The control: the check that passes the lock fails the pins that broke the old requirements.txt
    (the lock pins both for the Pythons after these, where the check passes them)."""
    run = pip_dry_run(version, {name: Version(release)}, tmp_path)
    assert run.returncode != 0
    assert f"No matching distribution found for {name}=={release}" in run.output, run.output


def test_the_walk_finds_a_missing_and_a_needless_pin(checked):
    """The control of the dependency walk: the lock's 3.10 lines without exceptiongroup, which
    several packages need before 3.11 only, and 3.13's lines with tomli, which 3.11 made needless."""
    check = checked["3.10.0"]
    without = {name: pinned for name, pinned in check.pins.items() if name != "exceptiongroup"}
    unmet, _ = walk("3.10.0", without, check.wheels)
    assert unmet and all("exceptiongroup" in problem for problem in unmet), unmet

    newest = checked[PYTHONS[-1]]
    with_tomli = newest.pins | {"tomli": check.pins["tomli"]}
    unmet, needless = walk(PYTHONS[-1], with_tomli, newest.wheels)
    assert (unmet, needless) == ([], ["tomli"])


def test_torch_pins_the_cuda_libraries_the_lock_leaves_out(checked):
    """make lock leaves them out because torch's metadata names their versions: exactly, but for
    cuda-bindings (a range below 14, as the Makefile says)."""
    if sys.platform != "linux":
        pytest.skip("torch's wheels name CUDA libraries on Linux only")
    check = checked["3.11.7"]
    torch = check.wheels["torch", check.pins["torch"]]
    env = environment("3.11.7") | {"extra": ""}
    cuda = [Requirement(r) for r in torch.requires_dist if canonicalize_name(Requirement(r).name) in OMITTED]
    cuda = [r for r in cuda if r.marker is None or r.marker.evaluate(env)]
    assert cuda, "torch from PyPI names no CUDA library"
    loose = sorted(r.name for r in cuda if [s.operator for s in r.specifier] != ["=="])
    assert loose == ["cuda-bindings"], [str(r) for r in cuda]
    assert not OMITTED & set(pins_for("3.11.7")), "the lock pins a package that make lock leaves out"


def test_the_checked_pythons_are_the_supported_ones():
    """check_python.py's range is the lock's: make lock resolves from its oldest, the test checks each."""
    oldest, newest = check_python.OLDEST, check_python.NEWEST
    assert make_variable("LOCK_PYTHON") == f"{oldest[0]}.{oldest[1]}"
    assert {Version(v).release[:2] for v in PYTHONS} == {(3, minor) for minor in range(oldest[1], newest[1] + 1)}
    assert f'requires-python = ">={oldest[0]}.{oldest[1]}"' in (REPO / "pyproject.toml").read_text()


FAKE_PYTHON = """#!{python}
# Python {version} as tools/check_python.py sees it: this interpreter with another sys.version_info{note}.
import collections, runpy, sys
sys.version_info = collections.namedtuple("version_info", "major minor micro releaselevel serial")(
    {major}, {minor}, {micro}, "final", 0)
{hide}
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def fake_python(folder: Path, version: str, ensurepip: bool = True) -> Path:
    major, minor, micro = version.split(".")
    path = folder / f"python{version}"
    path.write_text(FAKE_PYTHON.format(
        python=sys.executable, version=version, major=major, minor=minor, micro=micro,
        note="" if ensurepip else ", and no ensurepip (Debian without python3.X-venv)",
        hide="" if ensurepip else "sys.modules['ensurepip'] = None"))
    path.chmod(0o755)
    return path


def make_venv(python, venv: Path, *flags: str) -> subprocess.CompletedProcess:
    """`make venv PYTHON=... VENV=...` in the repository, as a reader types it (not as a sub-make)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "--no-print-directory", *flags, "venv", f"PYTHON={python}", f"VENV={venv}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


REFUSALS = [
    ("3.9.18", True, "the book needs Python 3.10 to 3.13, and this is Python 3.9.18"),
    ("3.14.0", True, "the book needs Python 3.10 to 3.13, and this is Python 3.14.0"),
    ("3.11.2", False, "has no ensurepip, which python -m venv needs to install pip: "
                      "on Debian or Ubuntu, apt-get install python3.11-venv"),
]


@pytest.mark.parametrize(("version", "ensurepip", "says"), REFUSALS,
                         ids=["3.9.18", "3.14.0", "3.11.2-without-ensurepip"])
def test_make_venv_refuses_in_one_line_and_creates_nothing(version, ensurepip, says, tmp_path):
    done = make_venv(fake_python(tmp_path, version, ensurepip), tmp_path / "venv")
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode != 0 and len(lines) == 1 and says in lines[0], lines
    assert not (tmp_path / "venv").exists()


def test_make_venv_refuses_a_python_it_cannot_find(tmp_path):
    done = make_venv(tmp_path / "python3.12", tmp_path / "venv")
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode != 0 and len(lines) == 1 and "python3.12 not found" in lines[0], lines
    assert not (tmp_path / "venv").exists()


def test_make_venv_takes_a_supported_python(tmp_path):
    """The control: the same make, dry (-n), goes on to create the venv with a 3.13 that has ensurepip."""
    python = fake_python(tmp_path, "3.13.0")
    done = make_venv(python, tmp_path / "venv", "-n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{python} -m venv {tmp_path / 'venv'}" in done.stdout


def real_python_3_9() -> str | None:
    found = sorted(Path.home().glob(".pyenv/versions/3.9*/bin/python"))
    return str(found[-1]) if found else shutil.which("python3.9")


@pytest.mark.skipif(real_python_3_9() is None, reason="no Python 3.9 here (python3.9, or pyenv's)")
def test_make_venv_refuses_a_real_python_3_9(tmp_path):
    done = make_venv(real_python_3_9(), tmp_path / "venv")
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode != 0 and len(lines) == 1, lines
    assert re.search(r"\*\*\* the book needs Python 3\.10 to 3\.13, and this is Python 3\.9\.\d+ \(", lines[0]), lines
    assert not (tmp_path / "venv").exists()
