"""Chapter 3's diagrams are current and correct, and the code its pages show fits the page."""

import ch3_figures
import pytest

from check_book import LISTING_WIDTH, listing_problems
from support import REPO

CHAPTER = sorted((REPO / "notebooks" / "ch3_ddp").glob("*.ipynb"))
# Listings that chapter 3 shows but does not own; each needs its owner to wrap it.
NOT_OURS = ("ch3_train.sbatch",)  # scripts/slurm: the cluster chapter's (issue #7, item 5)


@pytest.mark.parametrize("name", sorted(ch3_figures.FIGURE_FUNCTIONS))
def test_figure_files_are_what_the_generator_draws(name):
    """book/figures/*.svg are generated; a hand edit or a stale file would drift from the code."""
    on_disk = (ch3_figures.FIGURES / name).read_text()
    assert on_disk == ch3_figures.FIGURE_FUNCTIONS[name](), "run: python tools/ch3_figures.py"
    assert on_disk.startswith("<svg") and "http" not in on_disk.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""), "no external references: it renders offline"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_allreduce_figure_runs_the_algorithm(world):
    states = ch3_figures.ring_allreduce_states(world)
    everyone = frozenset(range(world))
    assert len(states) == 2 * (world - 1) + 1  # start, W-1 reduce-scatter, W-1 all-gather steps
    _, after_reduce_scatter, _ = states[world - 1]
    for rank in range(world):  # each rank owns exactly one complete chunk, the one after its own
        complete = [c for c in range(world) if after_reduce_scatter[rank][c] == everyone]
        assert complete == [(rank + 1) % world]
    _, final, _ = states[-1]
    assert all(chunk == everyone for row in final for chunk in row)
    for _, _, sends in states[1:]:  # every rank sends exactly one chunk per step
        assert sorted(rank for rank, _ in sends) == list(range(world))


@pytest.mark.parametrize("notebook", CHAPTER, ids=lambda p: p.name)
def test_shown_code_fits_the_page(notebook):
    problems = [p for p in listing_problems(notebook) if not any(n in p for n in NOT_OURS)]
    assert problems == [], f"lines over {LISTING_WIDTH} characters"


def test_listing_check_finds_wide_code(tmp_path):
    """The check above must be able to fail: a wide code cell, fence and pyobject are all found."""
    import json

    script = tmp_path / "wide.py"
    script.write_text("def narrow():\n    return 1\n\n\ndef wide():\n    return '" + "x" * 90 + "'\n")
    cells = [{"cell_type": "code", "source": "y = 1\n" + "z = " + "1 + " * 30, "metadata": {}},
             {"cell_type": "markdown", "source": "```python\n" + "q" * 86 + "\n```", "metadata": {}},
             {"cell_type": "markdown", "metadata": {},
              "source": f"```{{literalinclude}} {script.name}\n:pyobject: wide\n```\n\n"
                        f"```{{literalinclude}} {script.name}\n:pyobject: narrow\n```"}]
    notebook = tmp_path / "nb.ipynb"
    notebook.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    problems = listing_problems(notebook)
    assert len(problems) == 3, problems
    assert any("wide.py:wide" in p for p in problems) and not any(":narrow" in p for p in problems)
