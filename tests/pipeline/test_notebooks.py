"""The book as a whole: sources stripped, every notebook executes, the HTML has every page."""

import json

import pytest

from build_book import BuildError, resolve_entry, toc_entries, toc_notebooks
from check_book import executed_problems, html_problems, prose_problems, source_problems
from support import REPO

NOTEBOOKS = sorted(p for p in (REPO / "notebooks").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_source_is_stripped_and_parameterised(notebook):
    assert source_problems(notebook) == []


def test_the_table_of_contents_lists_exactly_the_notebooks_there_are():
    assert sorted(toc_notebooks(REPO)) == NOTEBOOKS
    assert len(NOTEBOOKS) >= 6


def test_every_toc_entry_resolves_to_a_file():
    unresolved = []
    for entry in toc_entries(REPO / "_toc.yml"):
        try:
            resolve_entry(entry, REPO)
        except BuildError as err:
            unresolved.append(str(err))
    assert unresolved == []


def test_every_notebook_executes_without_stored_errors(book):
    executed = [book / "source" / p.relative_to(REPO) for p in toc_notebooks(REPO)]
    problems = []
    for path in executed:
        assert path.is_file(), f"{path} was not executed"
        problems += executed_problems(path)
        nb = json.loads(path.read_text())
        ran = [c for c in nb["cells"] if c["cell_type"] == "code" and c.get("execution_count")]
        assert ran, f"{path}: no code cell ran"
    assert problems == []


def test_html_has_every_page_and_image(book):
    html = book / "_build" / "html"
    assert (html / "index.html").is_file()
    assert html_problems(html, toc_entries(REPO / "_toc.yml")) == []


def test_first_program_page_shows_its_executed_output(book):
    page = (book / "_build" / "html" / "notebooks/ch2_first_steps/01_first_distributed_program.html").read_text()
    assert "all_reduce result on every rank" in page  # printed by an executed cell, not typed in the prose
    assert "ran on: gloo" in page or "ran on: nccl" in page  # the provenance line under the run


PAGES = NOTEBOOKS + sorted((REPO / "book").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_prose_names_the_cells_it_claims_and_links_the_pages_it_cites(page):
    assert prose_problems([page], REPO) == []
