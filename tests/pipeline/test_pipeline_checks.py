"""Each check of the pipeline fails when its property breaks: fed a bad input, it says so."""

import json
import shutil
import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from check_book import (
    claim_problems,
    executed_problems,
    html_problems,
    prose_problems,
    source_problems,
    typed_reference_problems,
)
from support import REPO

KERNEL = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}


def write_notebook(path, *code, kernel=KERNEL, parameters=True):
    """A page of code cells; a cell made with new_markdown_cell (or any cell) goes in as it is."""
    cells = [new_markdown_cell("# A page")]
    if parameters:
        cells.append(new_code_cell("STEPS = 10", metadata={"tags": ["parameters", "hide-input"]}))
    cells += [c if isinstance(c, dict) else new_code_cell(c, metadata={"tags": ["hide-input"]} if i == 0 else {})
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


def test_source_check_wants_a_chapter_section_to_end_with_pitfalls_exercises_and_summary(tmp_path):
    """The control: 1.4 once lost all three when an edit replaced its last cell."""
    closing = new_markdown_cell("## Pitfalls\n- one\n\n## Exercises\n1. one\n\n## Summary\nDone.")
    assert source_problems(write_notebook(tmp_path / "ch9_x" / "ok.ipynb", "x = 1", closing)) == []
    cut = new_markdown_cell("## Pitfalls\n- one\n\n## Summary\nDone.")
    problems = source_problems(write_notebook(tmp_path / "ch9_x" / "cut.ipynb", "x = 1", cut))
    assert len(problems) == 1 and "## Exercises" in problems[0]
    swapped = new_markdown_cell("## Summary\nDone.\n\n## Pitfalls\n- one\n\n## Exercises\n1. one")
    assert source_problems(write_notebook(tmp_path / "ch9_x" / "swapped.ipynb", "x = 1", swapped))
    after = new_markdown_cell("## Pitfalls\n- one\n\n## Exercises\n1. one\n\n## Summary\nDone."
                              "\n\n## Further reading\n- one")
    problems = source_problems(write_notebook(tmp_path / "ch9_x" / "after.ipynb", "x = 1", after))
    assert len(problems) == 1 and "'## Further reading'" in problems[0]
    assert source_problems(write_notebook(tmp_path / "appendix" / "page.ipynb", "x = 1")) == []
    # A folder whose name merely starts with "ch" is not a chapter's.
    assert source_problems(write_notebook(tmp_path / "checks" / "page.ipynb", "x = 1")) == []


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


def test_html_check_finds_a_cross_reference_that_did_not_resolve(tmp_path):
    # What Sphinx writes for {ref}`its cell <label>` when the label exists, and when it does not
    # (jupyter-book build without -W; tools/build_book.py passes --warningiserror --nitpick).
    linked = '<a class="reference internal" href="a.html#ch9-1-x"><span class="std std-ref">its cell</span></a>'
    (tmp_path / "a.html").write_text(f"<html><head><title>A</title></head><body>{linked}</body></html>")
    (tmp_path / "b.html").write_text('<html><head><title>B</title></head><body>'
                                     '<span class="xref std std-ref">its cell</span></body></html>')
    assert html_problems(tmp_path, ["a"]) == []
    problems = html_problems(tmp_path, ["a", "b"])
    assert len(problems) == 1 and "b.html" in problems[0] and "did not resolve" in problems[0]


# --- prose checks: claims name their cell, pages link the pages they cite ---------------------

ASSERTING = "x = 2\nassert x == 2"
PRINTING = "x = 2\nprint(x)"


def test_claim_check_finds_an_asserted_below_that_names_no_cell(tmp_path):
    page = write_notebook(tmp_path / "p.ipynb", new_markdown_cell("Two equals two (asserted below)."), ASSERTING)
    problems = claim_problems(page)
    assert len(problems) == 1 and "names none" in problems[0]


def test_claim_check_finds_a_named_cell_that_asserts_nothing(tmp_path):
    page = write_notebook(tmp_path / "p.ipynb", new_markdown_cell(
        "Two equals two (asserted in {ref}`the cell below <ch9-1-two>`).\n\n(ch9-1-two)="), PRINTING)
    problems = claim_problems(page)
    assert len(problems) == 1 and "hold no assert" in problems[0]


def test_claim_check_accepts_a_claim_that_names_an_asserting_cell(tmp_path):
    # The control of the two tests above: the same page, labelled, with the assert.
    page = write_notebook(tmp_path / "p.ipynb", new_markdown_cell(
        "Two equals two (asserted in {ref}`the cell below <ch9-1-two>`, with `x == 2`).\n\n(ch9-1-two)="),
        ASSERTING, new_markdown_cell("The loss is measured below in {ref}`the same cell <ch9-1-two>`."))
    assert claim_problems(page) == []


def test_claim_check_finds_a_bare_reference_to_a_cell_label(tmp_path):
    # A code cell has no title, so Sphinx cannot make a bare {ref}`label` to it a link: the HTML
    # build fails. The same reference with its own text is the control, and passes.
    bare = write_notebook(tmp_path / "bare.ipynb", new_markdown_cell("The check:\n\n(ch9-1-two)="), ASSERTING,
                          new_markdown_cell("See {ref}`ch9-1-two` for the check."))
    problems = claim_problems(bare)
    assert len(problems) == 1 and "has no title" in problems[0]
    texted = write_notebook(tmp_path / "texted.ipynb", new_markdown_cell("The check:\n\n(ch9-1-two)="), ASSERTING,
                            new_markdown_cell("See {ref}`the check <ch9-1-two>`."))
    assert claim_problems(texted) == []


def test_claim_check_resolves_a_label_on_another_page(tmp_path):
    write_notebook(tmp_path / "notebooks" / "ch9" / "01_a.ipynb",
                   new_markdown_cell("The check:\n\n(ch9-1-two)="), ASSERTING)
    citing = write_notebook(tmp_path / "notebooks" / "ch9" / "02_b.ipynb", new_markdown_cell(
        "The previous page asserts that two equals two ({ref}`its cell <ch9-1-two>`)."))
    assert prose_problems([citing], tmp_path) == []
    assert len(claim_problems(citing)) == 1  # control: the page's own labels alone do not have it


@pytest.mark.parametrize("claim", [
    "The assertions below check both.",
    "This is checked in the next cell.",
    "The next cell checks both.",
    "Both are verified below.",
])
def test_claim_check_finds_other_words_for_a_claimed_check(tmp_path, claim):
    page = write_notebook(tmp_path / "p.ipynb", new_markdown_cell(claim), ASSERTING)
    assert len(claim_problems(page)) == 1, claim


def test_claim_check_reads_the_pages_of_book_and_finds_a_label_set_twice(tmp_path):
    (tmp_path / "book").mkdir()
    page = tmp_path / "book" / "intro.md"
    page.write_text("# Intro\n\nEvery page asserts below what it says.\n")
    assert len(claim_problems(page)) == 1
    for name in ("01_a", "02_b"):
        write_notebook(tmp_path / "notebooks" / "ch9" / f"{name}.ipynb",
                       new_markdown_cell("The check:\n\n(ch9-1-two)="), ASSERTING)
    page.write_text("# Intro\n\nNothing is claimed here.\n")
    problems = prose_problems([page], tmp_path)
    assert len(problems) == 1 and "also set in" in problems[0]


@pytest.mark.parametrize("text", [
    "Checkpoints are in section 3.8.",
    "Tensor parallelism (8.1, 8.2) splits every layer.",
    "As chapter 3, section 6 measured, the overlap is partial.",
    "The control runs in 3.8.",
    "In 3.8 the control runs.",
    "See 3.8 for the control.",
    "3.8 shows the control.",
    "Sec. 3.8 shows the control.",
    "The controls (3.8; 4.1) agree.",
    "The controls (3.8–4.1) agree.",
    "The control is on page **3.8**.",
    "The control is [3.8](../ch3_ddp/08_checkpointing_and_resuming.ipynb).",
    "The control is in sections 4.2-4.4.",
    "```{note}\nSee section 3.8.\n```",
    "{doc}`../ch3_ddp/01_how_ddp_works` and, in 3.8, `torch.save`.",  # a role's backticks pair with no code span
])
def test_typed_reference_check_finds_a_typed_section_number(tmp_path, text):
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\n{text}\n")
    assert len(typed_reference_problems(page)) == 1, text


@pytest.mark.parametrize("text", [
    "torch 2.13 picks the kernel, and Lightning 2.6 wraps it.",
    "FSDP takes 1.5 times DDP's step, a ratio of 1.5 times at most; the share is 0.79.",
    "2.5 s pass. 1.5 times DDP is the rule. The run took 3.2 ms.",
    "The script calls `section 3.8` and `see 8.1`; the formula is $t = 8.1 \\cdot b$.",
    "```python\nprint('see section 3.8')\n```",
    "Chapter 3 and chapter 5 run it; {doc}`../ch3_ddp/08_checkpointing_and_resuming` saves it.",
])
def test_typed_reference_check_leaves_versions_ratios_code_and_math_alone(tmp_path, text):
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\n{text}\n")
    assert typed_reference_problems(page) == [], text


def test_typed_reference_check_reads_the_markdown_cells_of_a_notebook(tmp_path):
    page = write_notebook(tmp_path / "p.ipynb", new_markdown_cell("See section 3.8."), "x = 'section 3.8'")
    problems = typed_reference_problems(page)
    assert len(problems) == 1 and "markdown cell 2" in problems[0]


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
