"""Every page shows code that fits it: code cells, fenced blocks and included listings."""

import json

import pytest

from build_book import resolve_entry, toc_entries
from check_book import LISTING_WIDTH, listing_problems
from support import REPO


@pytest.mark.parametrize("entry", toc_entries(REPO / "_toc.yml"))
def test_shown_code_fits_the_page(entry):
    assert listing_problems(resolve_entry(entry, REPO)) == [], f"lines over {LISTING_WIDTH} characters"


def test_listing_check_finds_wide_code(tmp_path):
    """The check must be able to fail: a wide code cell, fence and pyobject are all found, and a
    hidden cell's line that would fit an open cell, since the toggle's frame is narrower."""
    script = tmp_path / "wide.py"
    script.write_text("def narrow():\n    return 1\n\n\ndef wide():\n    return '" + "x" * 90 + "'\n")
    at_the_limit = "k = '" + "x" * (LISTING_WIDTH - 6) + "'"
    cells = [{"cell_type": "code", "source": "y = 1\n" + "z = " + "1 + " * 30, "metadata": {}},
             {"cell_type": "code", "source": at_the_limit, "metadata": {}},
             {"cell_type": "code", "source": at_the_limit, "metadata": {"tags": ["hide-input"]}},
             {"cell_type": "markdown", "source": "```python\n" + "q" * 86 + "\n```", "metadata": {}},
             {"cell_type": "markdown", "metadata": {},
              "source": f"```{{literalinclude}} {script.name}\n:pyobject: wide\n```\n\n"
                        f"```{{literalinclude}} {script.name}\n:pyobject: narrow\n```"}]
    notebook = tmp_path / "nb.ipynb"
    notebook.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    problems = listing_problems(notebook)
    assert len(problems) == 4, problems
    assert any("cell 3:" in p for p in problems) and not any("cell 2:" in p for p in problems)
    assert any("wide.py:wide" in p for p in problems) and not any(":narrow" in p for p in problems)


def test_a_markdown_page_is_checked_too(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```bash\n" + "echo " + "x" * 90 + "\n```\n")
    assert len(listing_problems(page)) == 1
