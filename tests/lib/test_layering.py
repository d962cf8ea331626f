"""The library's one-way structure: scripts import dtbook, never the reverse; the notebook side is torch-free."""

import ast
import subprocess
import sys

import pytest

from support import SCRIPTS

LIBRARY = SCRIPTS / "dtbook"
NOTEBOOK_SIDE = {"launch", "output_filters", "paths", "ports", "metrics", "cli", "reproducibility", "plots",
                 "cost_model", "cluster_lab", "slurm_lab", "intervals", "capacity", "gpu_report",
                 "exposed"}
WORKER_SIDE = {"distributed", "model", "data", "checkpoint", "ddp_inspect", "comm_timing", "measure",
               "timing", "progress", "collectives", "compare", "tensor_parallel", "pipeline"}
SCRIPT_NAMES = {p.stem for p in SCRIPTS.glob("ch*.py")}


def imported_modules(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_split_covers_every_module():
    modules = {p.stem for p in LIBRARY.glob("*.py")} - {"__init__"}
    assert modules == NOTEBOOK_SIDE | WORKER_SIDE


@pytest.mark.parametrize("module", sorted(p.stem for p in LIBRARY.glob("*.py")))
def test_the_library_never_imports_a_script(module):
    imports = imported_modules(LIBRARY / f"{module}.py")
    assert not imports & SCRIPT_NAMES
    assert "common" not in imports


@pytest.mark.parametrize("module", sorted(WORKER_SIDE))
def test_worker_code_never_imports_the_launcher(module):
    imports = imported_modules(LIBRARY / f"{module}.py")
    assert not {"dtbook.launch", "dtbook.output_filters"} & imports


def test_scripts_import_the_library_not_each_other():
    for script in SCRIPTS.glob("ch*.py"):
        imports = imported_modules(script)
        assert not imports & SCRIPT_NAMES, script.name
        assert any(name.startswith("dtbook") for name in imports), f"{script.name} does not use dtbook"


def test_the_notebook_side_imports_without_torch():
    """A fresh interpreter: importing every notebook-side module must not pull torch in."""
    code = ("import sys\n" + "".join(f"import dtbook.{m}\n" for m in sorted(NOTEBOOK_SIDE))
            + "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
