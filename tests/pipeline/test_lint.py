import json
import re
import subprocess
import sys
from pathlib import Path

from support import REPO


def test_ruff_is_clean():
    ruff = Path(sys.executable).with_name("ruff")
    done = subprocess.run([str(ruff), "check", "."], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# A fixed absolute tolerance means something else on another CPU, world size or step count: weight
# comparisons go through dtbook.compare, whose tolerance is scaled by the runs (CONTRIBUTING.md).
BARE_TOLERANCE = re.compile(r"\batol\s*=|\babs_tol\s*=|\ballclose\s*\(|\bassert_close\s*\(")


def bare_tolerances(name: str, code: str) -> list[str]:
    return [f"{name}:{number}: {line.strip()}" for number, line in enumerate(code.splitlines(), 1)
            if BARE_TOLERANCE.search(line.split("#")[0])]


def code_in_the_book() -> dict[str, str]:
    """Every test, script and notebook code cell, by name."""
    code = {p.relative_to(REPO).as_posix(): p.read_text()
            for folder in ("tests", "scripts", "tools") for p in (REPO / folder).rglob("*.py")}
    for notebook in (REPO / "notebooks").rglob("*.ipynb"):
        cells = json.loads(notebook.read_text())["cells"]
        for index, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                code[f"{notebook.relative_to(REPO).as_posix()}[{index}]"] = "".join(cell["source"])
    return code


def test_no_weight_comparison_uses_a_bare_absolute_tolerance():
    found = [hit for name, code in code_in_the_book().items() if name != "tests/pipeline/test_lint.py"
             for hit in bare_tolerances(name, code)]
    assert found == [], "compare weights with dtbook.compare, not a fixed tolerance:\n" + "\n".join(found)


def test_the_tolerance_lint_catches_what_it_forbids():
    """The control: each forbidden form is found, a comment or the library's call is not."""
    forbidden = ["torch.allclose(a, b, rtol=1e-3, atol=1e-4)", "assert_close(x, y)",
                 "math.isclose(a, b, abs_tol=1e-6)", "ok = a.allclose(b)"]
    assert all(bare_tolerances("x", line) for line in forbidden)
    allowed = ["compare_training(ref, runs, controls, steps=30)", "x = 1  # unlike allclose(a, b)"]
    assert not any(bare_tolerances("x", line) for line in allowed)
