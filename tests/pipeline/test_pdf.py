"""The book as one PDF (`make pdf`): every page of the table of contents is in it, in order, under its
title, with the code cells the HTML folds away printed open, and nothing cut at the paper's edge."""

import functools
import json
import re
import subprocess
import sys
import unicodedata

import pytest
import yaml

from build_book import resolve_entry, toc_entries
from build_pdf import chapter_files
from check_book import page_title
from support import REPO

BUILD_PDF = REPO / "tools" / "build_pdf.py"
PAGES_PER_ENTRY = 30  # a page of the table of contents prints on fewer pages than this: more is runaway breaks


def normal(text: str) -> str:
    """Text as compared: ligatures and typographic quotes undone, whitespace (where a PDF's lines
    break, or its extractor puts spaces) dropped. Chromium does not hyphenate, so a hyphen is real."""
    text = unicodedata.normalize("NFKC", text).replace("\u00ad", "")
    text = text.translate(str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'}))
    return re.sub(r"\s+", "", text)


@pytest.fixture(scope="module")
def printed(book, tmp_path_factory):
    """The book printed by the tool `make pdf` runs, its output, and the PDF opened with pypdf."""
    from pypdf import PdfReader

    pdf = tmp_path_factory.mktemp("pdf") / "book.pdf"
    done = subprocess.run([sys.executable, str(BUILD_PDF), "--book", str(book), "--out", str(pdf)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"build_pdf.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done, PdfReader(pdf)


def toc_levels(toc: dict) -> dict[str, int]:
    """Each file of a Jupyter Book table of contents and its depth: the root 0, a chapter 1, its
    sections 2 and so on, as the single page nests their headings (part captions are no heading)."""
    levels = {toc["root"]: 0}

    def walk(entries, depth):
        for entry in entries:
            levels[entry["file"]] = depth
            walk(entry.get("sections", []), depth + 1)

    for part in toc.get("parts", [toc]):
        walk(part.get("chapters", []), 1)
    return levels


@pytest.fixture(scope="module")
def sections(book, printed):
    """Each page of the table of contents: its executed source, its title, and the PDF page of its
    bookmark: the next one in the PDF's outline (the headings, as Chromium writes them) at its depth
    that holds the title. Holds, not is: Chromium sometimes writes a heading's text twice there."""
    reader = printed[1]
    outline = []

    def walk(items, depth):
        for item in items:
            if isinstance(item, list):
                walk(item, depth + 1)
            else:
                outline.append((depth, normal(item.title), reader.get_destination_page_number(item)))

    walk(reader.outline, 0)
    source = book / "source"
    levels = toc_levels(yaml.safe_load((source / "_toc.yml").read_text()))
    found, at = [], 0
    for entry in toc_entries(source / "_toc.yml"):
        page = resolve_entry(entry, source)
        title = page_title(page)
        assert title, f"{page} has no title"
        at = next((i for i in range(at, len(outline))
                   if outline[i][0] == levels[entry] and normal(title) in outline[i][1]), None)
        assert at is not None, f"no bookmark for {title!r} ({entry}) after the previous page's"
        found.append((entry, page, title, outline[at][2]))
    return found


@pytest.fixture(scope="module")
def text(printed):
    """The normalised text of a PDF page by its number (0 first; past the last page, none), each
    page extracted once: pypdf takes about 0.2 s a page, so only the pages checked are read."""
    reader = printed[1]

    @functools.cache
    def page_text(number: int) -> str:
        return normal(reader.pages[number].extract_text()) if number < len(reader.pages) else ""

    return page_text


def test_the_pdf_prints_nothing_cut(printed):
    """Nothing is wider than the paper: code and outputs wrap, and no table or image runs off it."""
    done = printed[0]
    assert "build_pdf: warning" not in done.stderr, done.stderr
    assert "The PDF is at" in done.stdout


def test_every_section_title_is_printed_on_its_page(sections, text):
    missing = [(title, number + 1) for _, _, title, number in sections if normal(title) not in text(number)]
    assert missing == [], f"titles not in the text of the page their bookmark points at: {missing}"


def test_a_title_not_in_the_book_is_not_found(sections, text, printed):
    """The control: the comparison (whitespace and quotes normalised) still tells titles apart."""
    absent = normal("Chapter 9: Beyond the book")
    assert all(absent not in text(number) for *_, number in sections)
    assert all(absent != normal(item.title) for item in printed[1].outline if not isinstance(item, list))


def test_folded_cells_are_printed_open(sections, text):
    """The parameter cell of every notebook, tagged hide-input (folded on the HTML page), is printed:
    its first line is on the page of the section's title or the next one."""
    hidden = []
    for entry, page, _, number in sections:
        if page.suffix != ".ipynb":
            continue
        cells = [c for c in json.loads(page.read_text())["cells"] if c["cell_type"] == "code"]
        first = next(line for line in "".join(cells[0]["source"]).splitlines() if line.strip())
        if normal(first) not in text(number) + text(number + 1):
            hidden.append((entry, first))
    assert hidden == [], f"parameter cells not printed: {hidden}"


def test_page_count_and_paper_are_sane(book, sections, printed):
    """Every chapter starts a page, no page of the table of contents runs to dozens of pages, A4."""
    reader = printed[1]
    chapters = chapter_files(book / "source" / "_toc.yml")
    assert len(chapters) + 1 <= len(reader.pages) <= PAGES_PER_ENTRY * len(sections)
    starts = {number for entry, *_, number in sections if entry in chapters}
    assert len(starts) == len(chapters), "two chapters share a page"
    width, height = (float(v) for v in reader.pages[0].mediabox[2:])
    assert (round(width / 72 * 25.4), round(height / 72 * 25.4)) == (210, 297)


def test_a_missing_book_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(BUILD_PDF), "--book", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("build_pdf: error: no built book in"), done.stderr
