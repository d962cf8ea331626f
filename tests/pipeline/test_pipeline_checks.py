"""Each check of the pipeline fails when its property breaks: fed a bad input, it says so."""

import json
import shutil
import subprocess
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from check_book import executed_problems, html_problems, source_problems
from support import REPO

KERNEL = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}


def write_notebook(path, *code, kernel=KERNEL, parameters=True):
    cells = [new_markdown_cell("# A page")]
    if parameters:
        cells.append(new_code_cell("STEPS = 10", metadata={"tags": ["parameters", "hide-input"]}))
    cells += [new_code_cell(c, metadata={"tags": ["hide-input"]} if i == 0 else {})
              for i, c in enumerate(code)]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(new_notebook(cells=cells, metadata=kernel), str(path))
    return path


# --- source checks ---------------------------------------------------------------------------

def test_source_check_accepts_a_clean_notebook(tmp_path):
    assert source_problems(write_notebook(tmp_path / "ok.ipynb", "x = 1")) == []


def test_source_check_rejects_outputs(tmp_path):
    path = write_notebook(tmp_path / "dirty.ipynb", "print(1)")
    nb = nbformat.read(str(path), as_version=4)
    nb.cells[-1].outputs = [new_output("stream", name="stdout", text="1\n")]
    nb.cells[-1].execution_count = 1
    nbformat.write(nb, str(path))
    assert any("outputs" in p for p in source_problems(path))


def test_source_check_rejects_missing_parameters_cell_and_wrong_kernel(tmp_path):
    other = {"kernelspec": {"name": "julia-1.9", "display_name": "Julia", "language": "julia"}}
    problems = source_problems(write_notebook(tmp_path / "bad.ipynb", "x = 1", kernel=other, parameters=False))
    assert any("parameters" in p for p in problems)
    assert any("kernelspec" in p for p in problems)


def test_source_check_wants_a_lab_section_to_say_first_when_the_lab_cannot_run(tmp_path):
    lab = "from dtbook.cluster_lab import ClusterLab, require_lab"
    assert source_problems(write_notebook(tmp_path / "ok.ipynb", f"{lab}\nrequire_lab()",
                                          "lab = ClusterLab().up()")) == []
    late = source_problems(write_notebook(tmp_path / "late.ipynb", lab, "require_lab()\nClusterLab().up()"))
    assert len(late) == 1 and "must call require_lab()" in late[0]
    slurm = source_problems(write_notebook(tmp_path / "slurm.ipynb", f"{lab}\nrequire_lab()",
                                           "SlurmLab(ClusterLab().up())"))
    assert len(slurm) == 1 and "require_slurm()" in slurm[0]


def test_source_check_rejects_a_second_configuration_and_shown_set_up(tmp_path):
    """One configuration (no QUICK); the parameter and set-up cells' code is hidden."""
    path = write_notebook(tmp_path / "quick.ipynb", "MODEL = 'tiny' if QUICK else 'small'")
    assert any("QUICK" in p for p in source_problems(path))
    path = write_notebook(tmp_path / "shown.ipynb", "import torch")
    nb = nbformat.read(str(path), as_version=4)
    nb.cells[2].metadata = {}
    nbformat.write(nb, str(path))
    assert any("hide-input" in p for p in source_problems(path))


# --- executed-output checks -----------------------------------------------------------------

def test_executed_check_finds_stored_errors_and_tracebacks(tmp_path):
    path = write_notebook(tmp_path / "ran.ipynb", "1/0", "print('boom')")
    nb = nbformat.read(str(path), as_version=4)
    nb.cells[-2].outputs = [new_output("error", ename="ZeroDivisionError", evalue="division by zero", traceback=[])]
    nb.cells[-1].outputs = [new_output("stream", name="stderr",
                                       text="Traceback (most recent call last):\n  File 'x'\nValueError\n")]
    nbformat.write(nb, str(path))
    problems = executed_problems(path)
    assert len(problems) == 2
    assert "ZeroDivisionError" in problems[0] and "traceback" in problems[1]


def test_executed_check_finds_a_wall_of_output(tmp_path):
    path = write_notebook(tmp_path / "wall.ipynb", "for i in range(26): print(i)", "print('ok')")
    nb = nbformat.read(str(path), as_version=4)
    nb.cells[-2].outputs = [new_output("stream", name="stdout", text="".join(f"{i}\n" for i in range(26)))]
    nb.cells[-1].outputs = [new_output("stream", name="stdout", text="".join(f"{i}\n" for i in range(25)))]
    nbformat.write(nb, str(path))
    assert [p for p in executed_problems(path) if "26 lines" in p] and len(executed_problems(path)) == 1


def test_executed_check_counts_the_race_line_each_agent_may_add(tmp_path):
    from dtbook.output_filters import ExitBarrierRaceFilter

    def launch(names):
        return f"$ torchrun --nnodes={len(names)} scripts/x.py   # on {', '.join(names)}\n"

    race = "[node2] " + ExitBarrierRaceFilter.SHUTDOWN_SUMMARY
    path = write_notebook(tmp_path / "lab.ipynb", "launch()", "launch()", "launch()")
    nb = nbformat.read(str(path), as_version=4)
    # 20 lines, one of them a lost race, and three agents that may lose it: 22 at worst, passes.
    fits = [launch(["node0", "node1"]), launch(["node0", "node1", "node2"]), race] + ["row\n"] * 17
    # Four rows more: 24 lines on this run, 26 on a run where all three agents lose the race.
    tight = fits + ["row\n"] * 4
    # The control: agents on one machine print a line each; only the host (node 0) never races.
    local = [f"$ torchrun --node_rank={k} x.py   # node {k}\n" for k in range(3)] + ["row\n"] * 21
    for cell, text in zip(nb.cells[-3:], [fits, tight, local], strict=True):
        cell.outputs = [new_output("stream", name="stdout", text="".join(text))]
    nbformat.write(nb, str(path))
    problems = executed_problems(path)
    assert len(problems) == 2, problems
    assert "cell 3 printed 24 lines, and 26 when" in problems[0]
    assert "cell 4 printed 24 lines, and 26 when" in problems[1]


def test_executed_check_finds_a_value_shown_by_accident(tmp_path):
    path = write_notebook(tmp_path / "repr.ipynb", "[1, 2]", "display_link()")
    nb = nbformat.read(str(path), as_version=4)
    nb.cells[-2].outputs = [new_output("execute_result", data={"text/plain": "[1, 2]"},
                                       execution_count=1)]
    # The control: a rich result the cell shows on purpose (a download link) passes.
    nb.cells[-1].outputs = [new_output("execute_result", execution_count=2, data={
        "text/html": "<a download>trace</a>", "text/plain": "<HTML object>"})]
    nbformat.write(nb, str(path))
    problems = executed_problems(path)
    assert len(problems) == 1 and "code cell" in problems[0] and "repr" in problems[0]


# --- HTML checks ----------------------------------------------------------------------------

def test_html_check_finds_missing_pages_and_images(tmp_path):
    (tmp_path / "book").mkdir()
    (tmp_path / "book" / "intro.html").write_text(
        '<html><head><title>Intro</title></head><body><img src="../_images/there.png">'
        '<img src="../_images/missing.png"></body></html>')
    (tmp_path / "_images").mkdir()
    (tmp_path / "_images" / "there.png").write_bytes(b"png")
    problems = html_problems(tmp_path, ["book/intro", "book/setup"])
    assert len(problems) == 2
    assert any("missing.png" in p for p in problems)
    assert any("book/setup" in p for p in problems)


# --- the builder ----------------------------------------------------------------------------

def make_book(root, *notebooks):
    """A minimal book: this repository's config, an intro page, the given notebooks, the real scripts."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "_config.yml", root)
    shutil.copytree(REPO / "scripts", root / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "book").mkdir()
    (root / "book" / "intro.md").write_text("# Intro\n")
    chapters = "".join(f"  - file: {n}\n" for n in notebooks)
    (root / "_toc.yml").write_text(f"format: jb-book\nroot: book/intro\nchapters:\n{chapters}")


def build(root, *extra):
    return subprocess.run([sys.executable, str(REPO / "tools" / "build_book.py"), "--root", str(root),
                           "--no-html", "--cell-timeout", "60", *extra],
                          capture_output=True, text=True, timeout=300)


def test_builder_names_the_notebook_and_cell_that_raised(tmp_path):
    make_book(tmp_path, "notebooks/broken")
    write_notebook(tmp_path / "notebooks" / "broken.ipynb", "x = 1", "assert x == 2, 'the claim is false'")
    done = build(tmp_path)
    assert done.returncode != 0
    assert "notebooks/broken.ipynb" in done.stderr
    assert "cell" in done.stderr and "the claim is false" in done.stderr


def test_builder_names_a_missing_toc_entry(tmp_path):
    make_book(tmp_path, "notebooks/not_written_yet")
    done = build(tmp_path)
    assert done.returncode != 0
    assert "notebooks/not_written_yet" in done.stderr


def test_builder_fails_when_a_launched_script_fails(tmp_path):
    make_book(tmp_path, "notebooks/launches")
    write_notebook(tmp_path / "notebooks" / "launches.ipynb",
                   "from dtbook.launch import launch_torchrun",
                   "launch_torchrun('ch2_hello_distributed.py', ['--backend', 'nccl'], nproc=1, timeout=60)")
    done = build(tmp_path)
    assert done.returncode != 0
    assert "notebooks/launches.ipynb" in done.stderr and "RuntimeError" in done.stderr


def test_builder_skips_unchanged_notebooks_and_reruns_changed_ones(tmp_path):
    make_book(tmp_path, "notebooks/a", "notebooks/b")
    write_notebook(tmp_path / "notebooks" / "a.ipynb", "x = 1")
    write_notebook(tmp_path / "notebooks" / "b.ipynb", "y = 2")
    out = tmp_path / "_build"
    assert build(tmp_path, "--out", str(out)).returncode == 0
    write_notebook(tmp_path / "notebooks" / "b.ipynb", "y = 3")
    second = build(tmp_path, "--out", str(out))
    assert second.returncode == 0
    lines = {line.split()[0]: line for line in second.stdout.splitlines() if line.startswith("notebooks/")}
    assert "skipped" in lines["notebooks/a.ipynb"]
    assert "executed" in lines["notebooks/b.ipynb"]
    executed = json.loads((out / "source" / "notebooks" / "b.ipynb").read_text())
    assert "y = 3" in "".join(executed["cells"][-1]["source"])


def statuses(done) -> dict[str, str]:
    return {line.split()[0]: line.split()[1] for line in done.stdout.splitlines() if line.startswith("notebooks/")}


def test_builder_reruns_what_depends_on_a_changed_library_file_or_launched_script(tmp_path):
    """Every notebook depends on the whole library; a script counts even when launched by a computed name.

    Built with two notebooks side by side, as the test build is: each one's launches must be
    recorded against it, not against its neighbour."""
    make_book(tmp_path, "notebooks/plain", "notebooks/launcher")
    write_notebook(tmp_path / "notebooks" / "plain.ipynb", "x = 1")
    write_notebook(tmp_path / "notebooks" / "launcher.ipynb", "from dtbook.launch import launch_python",
                   "name = 'ch2_' + 'hello_distributed.py'  # no script name appears in this notebook's text",
                   "launch_python(name, ['--help'], metrics=False, timeout=60)")
    out = tmp_path / "_build"
    side_by_side = ["--out", str(out), "--jobs", "2"]
    assert build(tmp_path, *side_by_side).returncode == 0
    assert set(statuses(build(tmp_path, *side_by_side)).values()) == {"skipped"}

    with open(tmp_path / "scripts" / "dtbook" / "data.py", "a") as f:
        f.write("# touched\n")
    assert statuses(build(tmp_path, *side_by_side)) == {"notebooks/plain.ipynb": "executed",
                                                            "notebooks/launcher.ipynb": "executed"}
    with open(tmp_path / "scripts" / "ch2_hello_distributed.py", "a") as f:
        f.write("# touched\n")
    assert statuses(build(tmp_path, *side_by_side)) == {"notebooks/plain.ipynb": "skipped",
                                                            "notebooks/launcher.ipynb": "executed"}


def test_builder_builds_the_rest_when_a_section_cannot_run_on_this_machine(tmp_path):
    """A lab section on a machine without root or user namespaces says why in one line; the build
    lists it as not executed, stages its page with the reason, runs the rest and exits 0. The
    control, a section that fails for any other reason, fails the build (the tests above)."""
    make_book(tmp_path, "notebooks/lab", "notebooks/plain")
    write_notebook(tmp_path / "notebooks" / "lab.ipynb",
                   "from dtbook.cluster_lab import LabUnavailable\n"
                   "raise LabUnavailable('the cluster lab needs user namespaces here')")
    write_notebook(tmp_path / "notebooks" / "plain.ipynb", "y = 2")
    out = tmp_path / "_build"
    done = build(tmp_path, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert statuses(done) == {"notebooks/lab.ipynb": "not", "notebooks/plain.ipynb": "executed"}
    assert "notebooks/lab.ipynb: the cluster lab needs user namespaces here" in done.stdout
    staged = json.loads((out / "source" / "notebooks" / "lab.ipynb").read_text())
    assert "not executed" in "".join(staged["cells"][1]["source"]) and "user namespaces" in "".join(
        staged["cells"][1]["source"])
    # Not fingerprinted: the next build tries it again (a machine may have gained what it lacked).
    assert "not" == statuses(build(tmp_path, "--out", str(out)))["notebooks/lab.ipynb"]


def test_a_lab_that_fails_after_its_set_up_fails_the_build(tmp_path):
    """The control: past the set-up cell the machine can run the lab, so the same exception (all
    slots taken, a lab host that died) is a failure, not a section this machine cannot run."""
    make_book(tmp_path, "notebooks/lab")
    write_notebook(tmp_path / "notebooks" / "lab.ipynb", "from dtbook.cluster_lab import LabUnavailable",
                   "raise LabUnavailable('the lab host did not start')")
    done = build(tmp_path)
    assert done.returncode != 0 and "the lab host did not start" in done.stderr


def test_a_section_that_cannot_run_here_says_so_in_one_line_not_a_traceback(tmp_path):
    """What a reader sees in JupyterLab: IPython renders LabUnavailable as its one line."""
    from nbclient import NotebookClient

    path = write_notebook(tmp_path / "lab.ipynb", "from dtbook.slurm_lab import require_slurm\n"
                          "from dtbook import cluster_lab\n"
                          "cluster_lab.TOOLS['dtbook-no-such-tool'] = 'no-such-package'\n"
                          "require_slurm()", "raise RuntimeError('the control')")
    nb = nbformat.read(str(path), as_version=4)
    NotebookClient(nb, timeout=60, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    error, control = nb.cells[-2].outputs[-1], nb.cells[-1].outputs[-1]
    assert error.output_type == "error" and error.ename == "LabUnavailable"
    assert len(error.traceback) == 1, error.traceback
    assert "no-such-package" in error.traceback[0] and "apt-get install" in error.traceback[0]
    assert control.ename == "RuntimeError" and len(control.traceback) > 1
