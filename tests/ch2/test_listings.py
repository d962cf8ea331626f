"""Chapter 2's pages show code that fits the page (the check itself is tested in tests/ch3)."""

import pytest

from check_book import LISTING_WIDTH, listing_problems
from support import REPO

CHAPTER = sorted((REPO / "notebooks" / "ch2_first_steps").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", CHAPTER, ids=lambda p: p.name)
def test_shown_code_fits_the_page(notebook):
    assert listing_problems(notebook) == [], f"lines over {LISTING_WIDTH} characters"
