"""Checks on notebook sources, executed notebooks and the built HTML.

Each function returns a list of problems (empty means fine), so the test suite
can run them on the real book and on deliberately broken inputs alike.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

from dtbook.output_filters import ExitBarrierRaceFilter

OUTPUT_LINES = 25  # what one cell may print: more is a log wall, not a result a reader reads

# The launcher's line for the torchrun agents of one launch: "$ torchrun ...   # on node0, node1"
# on the lab, "$ torchrun ...   # node 1" per agent on one machine.
_AGENTS_LINE = re.compile(r"^\$ .*torchrun .*   # (?:on )?(.+)$")
_RACE_LINES = (ExitBarrierRaceFilter.SUMMARY, ExitBarrierRaceFilter.SHUTDOWN_SUMMARY)


def _printed_lines(cell: dict) -> tuple[int, int]:
    """How many lines a cell printed, and how many it may print on another run.

    Each torchrun agent that does not host the store may lose the exit-barrier race and add
    one summary line (``ExitBarrierRaceFilter``); whether it does depends on the machine's
    load, so a cell's budget counts that line for every such agent, present or not.
    """
    lines = "".join("".join(out.get("text", "")) for out in cell.get("outputs", [])
                    if out.get("output_type") == "stream").splitlines()
    races = sum(line.endswith(summary.rstrip("\n")) for line in lines for summary in _RACE_LINES)
    agents = [name for line in lines if (match := _AGENTS_LINE.match(line))
              for name in match.group(1).split(", ")]
    guests = sum(name not in ("node0", "node 0") for name in agents)
    return len(lines), len(lines) - races + guests


def source_problems(notebook: Path) -> list[str]:
    """A notebook source must be stripped, parameterised, and use the python3 kernel.

    There is one configuration, the one the reader runs: no ``QUICK`` switch. The parameter
    cell and the set-up cell after it are tagged ``hide-input``, so a page opens with the idea.
    """
    try:
        nb = json.loads(notebook.read_text())
    except (OSError, ValueError) as err:
        return [f"{notebook}: not a readable notebook ({err})"]
    problems = []
    code_cells = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    for i, cell in enumerate(code_cells, 1):
        if cell.get("outputs") or cell.get("execution_count") is not None:
            problems.append(f"{notebook}: code cell {i} carries outputs or an execution count (strip it)")
    tags = [c.get("metadata", {}).get("tags", []) for c in code_cells]
    if not tags or "parameters" not in tags[0]:
        problems.append(f"{notebook}: the first code cell is not tagged 'parameters'")
    elif len(tags) < 2 or not all("hide-input" in t for t in tags[:2]):
        problems.append(f"{notebook}: the parameter cell and the set-up cell after it need 'hide-input'")
    if any("QUICK" in "".join(c.get("source", "")) for c in nb.get("cells", [])):
        problems.append(f"{notebook}: mentions QUICK: the book has one configuration, the reader's")
    if re.fullmatch(r"ch\d+_.*", notebook.parent.name):  # a chapter's folder, not "checks"
        problems += [f"{notebook}: {p}" for p in _closing_section_problems(nb)]
    kernel = nb.get("metadata", {}).get("kernelspec", {}).get("name")
    if kernel != "python3":
        problems.append(f"{notebook}: kernelspec is {kernel!r}, expected 'python3'")
    problems += [f"{notebook}: {p}" for p in _lab_problems(["".join(c.get("source", "")) for c in code_cells])]
    return problems


# Every chapter section ends as the template in CONTRIBUTING.md says: an edit that replaces a
# page's last cell must not take these with it unnoticed.
CLOSING_SECTIONS = ("## Pitfalls", "## Exercises", "## Summary")


def _closing_section_problems(nb: dict) -> list[str]:
    """The closing headings must each appear once, in the template's order, Summary the last."""
    headings = [line.strip() for cell in nb.get("cells", []) if cell.get("cell_type") == "markdown"
                for line in "".join(cell.get("source", "")).splitlines() if line.startswith("## ")]
    found = [h for h in headings if h in CLOSING_SECTIONS]
    if found != list(CLOSING_SECTIONS):
        return [f"has {found or 'none'} of the closing headings {list(CLOSING_SECTIONS)}: a "
                "chapter section needs all three, once each, in that order (CONTRIBUTING.md)"]
    if headings[-1] != CLOSING_SECTIONS[-1]:
        return [f"its last '## ' heading is {headings[-1]!r}: a chapter section ends with "
                f"{CLOSING_SECTIONS[-1]!r} (CONTRIBUTING.md)"]
    return []


def _lab_problems(sources: list[str]) -> list[str]:
    """A section on the cluster lab says first, in its set-up cell, when this machine cannot run it."""
    text = "\n".join(sources)
    needed = "require_slurm()" if "SlurmLab" in text else "require_lab()" if "ClusterLab" in text else None
    if needed and (len(sources) < 2 or needed not in sources[1]):
        return [f"it uses the cluster lab, so its set-up cell (code cell 2) must call {needed} (CONTRIBUTING)"]
    return []


def executed_problems(notebook: Path) -> list[str]:
    """An executed notebook must not store an error or a traceback, nor print a wall of lines.

    A wall is more than ``OUTPUT_LINES`` lines in one cell, on this run or on a run where its
    torchrun agents lose a harmless race (``_printed_lines``).

    Jupyter Book happily renders a stored traceback, so this has to be checked here.
    """
    nb = json.loads(notebook.read_text())
    problems = []
    for i, cell in enumerate(c for c in nb.get("cells", []) if c.get("cell_type") == "code"):
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", "")) if out.get("output_type") == "stream" else ""
            if out.get("output_type") == "error":
                problems.append(f"{notebook}: code cell {i + 1} stored {out.get('ename')}: {out.get('evalue')}")
            elif "Traceback (most recent call last)" in text:
                problems.append(f"{notebook}: code cell {i + 1} printed a Python traceback")
            elif out.get("output_type") == "execute_result" and set(out.get("data", {})) == {"text/plain"}:
                # The value of a cell's last expression, shown by accident: a page prints what it
                # means to (a list of comparisons under the table that already shows them).
                problems.append(f"{notebook}: code cell {i + 1} shows its last expression's repr "
                                f"(end the line with ';' or print what matters)")
        shown, at_worst = _printed_lines(cell)
        if shown > OUTPUT_LINES:
            problems.append(f"{notebook}: code cell {i + 1} printed {shown} lines (at most {OUTPUT_LINES})")
        elif at_worst > OUTPUT_LINES:
            problems.append(f"{notebook}: code cell {i + 1} printed {shown} lines, and {at_worst} when its "
                            f"torchrun agents lose the harmless exit-barrier race (at most {OUTPUT_LINES})")
        if "papermill-error-cell-tag" in cell.get("metadata", {}).get("tags", []) or "papermill-error" in str(
            cell.get("source", "")
        ):
            problems.append(f"{notebook}: papermill marked an error at code cell {i + 1}")
    return problems


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images: list[str] = []
        self.title = ""
        self.unresolved: list[str] = []  # the classes of a cross-reference Sphinx left unlinked
        self._in_title = False
        self._links_open = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img" and attrs.get("src"):
            self.images.append(attrs["src"])
        self._in_title = tag == "title"
        self._links_open += tag == "a"
        # A {ref} or {doc} Sphinx resolves becomes <a ...><span class="std std-ref">; one it cannot
        # stays a bare <span class="xref std std-ref"> (what -W turns into a failed build).
        classes = (attrs.get("class") or "").split()
        if tag == "span" and "xref" in classes and not self._links_open:
            self.unresolved.append(" ".join(classes))

    def handle_data(self, data):
        if self._in_title:
            self.title += data

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False
        if tag == "a" and self._links_open:
            self._links_open -= 1


def html_problems(html_dir: Path, entries: list[str]) -> list[str]:
    """Every table-of-contents entry has a page, every local image a page shows exists, and every
    cross-reference ({ref}, {doc}) resolved to a link."""
    problems = []
    for entry in entries:
        page = html_dir / f"{entry}.html"
        if not page.is_file():
            problems.append(f"no HTML page for _toc.yml entry {entry!r} (expected {page})")
            continue
        parser = _Links()
        parser.feed(page.read_text())
        if not parser.title.strip():
            problems.append(f"{page}: page has no title")
        for classes in parser.unresolved:
            problems.append(f"{page}: a cross-reference ({classes}) did not resolve to a link")
        for src in parser.images:
            url = urlparse(src)
            if url.scheme in ("http", "https", "data"):
                continue
            if not (page.parent / unquote(url.path)).resolve().is_file():
                problems.append(f"{page}: image {src!r} does not exist")
    return problems


def page_title(page: Path) -> str | None:
    """A page's title as a reader sees it: its first level-1 heading, without inline code marks.

    ``page`` is a notebook (its markdown cells) or a markdown page; headings inside fenced code
    do not count. None when the page has no such heading.
    """
    if page.suffix == ".md":
        texts = [page.read_text()]
    else:
        texts = ["".join(c.get("source", "")) for c in json.loads(page.read_text()).get("cells", [])
                 if c.get("cell_type") == "markdown"]
    for text in texts:
        fenced = False
        for line in text.splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            elif not fenced and line.startswith("# "):
                return line[2:].strip().replace("`", "")
    return None


# The widest line of code the book's page shows without a scroll bar: at a 1366-pixel-wide
# window the theme's code blocks hold 85 characters (measured in Chromium; the browser
# check in tests/pipeline/test_browser.py measures the real pages).
LISTING_WIDTH = 85
# A code cell tagged hide-input sits in the toggle's frame, 20 pixels narrower: 83 characters.
HIDDEN_INPUT_WIDTH = 83


def _fenced_blocks(markdown: str) -> list[tuple[str, str]]:
    """(info string, body) of every ``` fenced block in a markdown cell."""
    blocks, lines, i = [], markdown.splitlines(), 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            info, body, i = lines[i].strip()[3:], [], i + 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((info, "\n".join(body)))
        i += 1
    return blocks


def _pyobject_lines(source: str, name: str) -> list[str] | None:
    """The lines of a function or class, as Sphinx's :pyobject: option shows them; a dotted name
    (``AlphaBeta.fit``) is a method of a top-level class."""
    import ast

    body = ast.parse(source).body
    *outer, last = name.split(".")
    for part in outer:
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == part]
        if not classes:
            return None
        body = classes[0].body
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == last:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return source.splitlines()[first - 1 : node.end_lineno]
    return None


def listing_problems(page: Path, width: int = LISTING_WIDTH) -> list[str]:
    """Code a page shows (code cells, fenced blocks, literalincludes) wider than ``width``.

    ``page`` is a notebook or a markdown page, which counts as one markdown cell.
    """
    if page.suffix == ".md":
        cells = [{"cell_type": "markdown", "source": page.read_text()}]
    else:
        cells = json.loads(page.read_text()).get("cells", [])
    problems = []

    def check(where: str, lines: list[str], limit: int = width) -> None:
        for line in lines:
            if len(line) > limit:
                problems.append(f"{page.name}: {where}: {len(line)} characters: {line.strip()[:60]}")

    for number, cell in enumerate(cells, 1):
        source = "".join(cell.get("source", ""))
        if cell.get("cell_type") == "code":
            hidden = "hide-input" in cell.get("metadata", {}).get("tags", [])
            check(f"cell {number}", source.splitlines(), min(width, HIDDEN_INPUT_WIDTH) if hidden else width)
            continue
        for info, body in _fenced_blocks(source):
            if not info.startswith("{literalinclude}"):
                if not info.startswith("{"):
                    check(f"cell {number} code block", body.splitlines())
                continue
            target = (page.parent / info.split(None, 1)[1].strip()).resolve()
            options = dict(line.strip()[1:].split(": ", 1) for line in body.splitlines()
                           if line.strip().startswith(":") and ": " in line)
            text = target.read_text()
            if "pyobject" in options:
                shown = _pyobject_lines(text, options["pyobject"])
                if shown is None:
                    problems.append(f"{page.name}: cell {number}: no {options['pyobject']} in {target.name}")
                    continue
            else:
                shown = text.splitlines()
            check(f"cell {number} {target.name}:{options.get('pyobject', '')}", shown)
    return problems


# --- Claims and cross-references in prose ----------------------------------------------------
#
# A sentence that says something is asserted (or checked, measured, shown ... below/above) names
# the cell it means with a MyST reference, {ref}`text <label>`, and the label is a target
# ``(label)=`` on the last line of the markdown cell right before that code cell. A claim of an
# assert (asserted, checked, verified, tested) needs an ``assert`` in that cell. Pages refer to
# each other with {doc}/{ref} links that the build resolves, never with a typed section number,
# which a renumbering silently leaves stale. Chapter numbers are fixed, so "chapter 3" may stay.

# A fenced block: code, or a directive whose body may be prose ({note}) or options (:caption:).
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})([^\n]*)\n(.*?)^[ \t]*\1[ \t]*$", re.S | re.M)
_CODE_DIRECTIVES = ("{code", "{literalinclude", "{math", "{mermaid", "{raw")
# Scanned left to right in one pass, so a role's backticks ({doc}`...`) never pair with a code
# span's: the role is kept (its text is prose and its target is what _REF reads), the rest goes.
_INLINE = re.compile(r"(\{[\w:.-]+\}`[^`]*`)|(`+).+?\2|\$\$.+?\$\$|\$[^$\n]+\$", re.S)
_CELL_TARGET = re.compile(r"\(([A-Za-z0-9_-]+)\)=\s*\Z")
_REF = re.compile(r"\{ref\}`(?:[^`<]*<)?([A-Za-z0-9_-]+)>?`")
_BARE_REF = re.compile(r"\{ref\}`([A-Za-z0-9_-]+)`")  # {ref}`label`: Sphinx takes its text from the target
_ASSERT_CLAIM = re.compile(
    r"\bassert(?:ed|s|ing)?\b|\bassertions?\s+(?:below|above)\b"          # "the assertions below"
    r"|\b(?:checked|verified|tested)\s+(?:below|above|in\s+the\s+(?:next\s+|following\s+)?cell)\b"
    r"|\b(?:next|following|previous)\s+cell\s+(?:checks|verifies|tests)\b", re.I)
_SHOW_CLAIM = re.compile(r"\b(?:measured|shown)\s+(?:below|above)\b", re.I)
_SECTION_NUMBER = r"[1-8]\.[1-9](?![\d])"
_NOT_A_SECTION = r"\s*(?:times|[mµ]?s|seconds?|[KMGT]i?B)\b"  # "a ratio of 1.5 times", "in 2.5 s"
_SECTION_LIST = rf"{_SECTION_NUMBER}(?:\s*(?:,|;|–|-|and|to)\s*{_SECTION_NUMBER})*"
_TYPED_REFERENCE = re.compile(
    r"\bsections?\s+\d|\bsecs?\.\s*\d"                                  # "section 5", "Sec. 3.8"
    r"|§\s*\d"                                                              # "§3.8"
    rf"|\(\s*{_SECTION_LIST}\s*\)"                                          # "(8.1, 8.2)", "(3.8–4.1)"
    rf"|\*\*{_SECTION_NUMBER}\*\*|\[{_SECTION_NUMBER}\]"                      # "**3.8**", "[3.8](...)"
    rf"|\b(?:in|see|of|from|as in|like|cf\.?|on|at|pages?|chapters?)\s+{_SECTION_LIST}"
    rf"(?![×x%\w]|{_NOT_A_SECTION})"                                          # "in 3.8", "See 3.8"
    rf"|(?:^|(?<=[.!?:]\s))\s*{_SECTION_NUMBER}(?!{_NOT_A_SECTION})\s+[a-z]",   # "3.8 shows" at a start
    re.I | re.M)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z*(\[])|\n\s*\n|\n\s*[-*|]\s|\n\s*\d+\.\s")


def _directive_body(fence: re.Match) -> str:
    """What a fenced block leaves as prose: an admonition's body, without its ``:option:`` lines."""
    info = fence.group(2).strip()
    if not info.startswith("{") or info.startswith(_CODE_DIRECTIVES):
        return "\n\n"
    body = [line for line in fence.group(3).splitlines() if not re.match(r"\s*:[\w-]+:", line)]
    return "\n\n" + "\n".join(body) + "\n\n"


def _prose(markdown: str) -> str:
    """Markdown without code blocks, code spans and math, where words are not the book's prose."""
    return _INLINE.sub(lambda m: m.group(1) or " ", _FENCE.sub(_directive_body, markdown))


def _cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text()).get("cells", [])


def cell_labels(notebook: Path) -> dict[str, str]:
    """{label: source of the code cell it labels} for every ``(label)=`` target before a code cell."""
    cells = _cells(notebook)
    labels = {}
    for cell, following in zip(cells, cells[1:], strict=False):
        match = _CELL_TARGET.search("".join(cell.get("source", "")))
        if cell.get("cell_type") == "markdown" and match and following.get("cell_type") == "code":
            labels[match.group(1)] = "".join(following.get("source", ""))
    return labels


def claim_problems(notebook: Path, labels: dict[str, str] | None = None) -> list[str]:
    """Every claim that a cell asserts or shows something names that cell, and the cell does it.

    ``labels`` are the book's cell labels (``cell_labels`` over every notebook), so a page may
    point at a cell on another page; by default the notebook's own.
    """
    if notebook.suffix != ".ipynb":  # a page of book/: its text is one markdown cell
        texts, labels = [(0, notebook.read_text())], labels or {}
    else:
        labels = cell_labels(notebook) if labels is None else labels
        texts = [(i, "".join(c.get("source", ""))) for i, c in enumerate(_cells(notebook))
                 if c.get("cell_type") == "markdown"]
    problems = []
    for i, text in texts:
        # A code cell has no title for Sphinx to print, so a bare {ref} to its label fails the
        # build ("a title or caption not found"): the link must bring its own text.
        for label in _BARE_REF.findall(_prose(text)):
            if label in labels:
                problems.append(f"{notebook}: markdown cell {i}: {{ref}}`{label}` points at a code "
                                f"cell, which has no title; write {{ref}}`some text <{label}>`")
        for sentence in _SENTENCE_END.split(_prose(text)):
            asserts, shows = _ASSERT_CLAIM.search(sentence), _SHOW_CLAIM.search(sentence)
            if not (asserts or shows):
                continue
            words = " ".join(sentence.split())[:90]
            refs = _REF.findall(sentence)
            named = [label for label in refs if label in labels]
            if not named:
                problems.append(f"{notebook}: markdown cell {i}: \"{words}\" claims a cell "
                                f"{'asserts' if asserts else 'shows'} it but names none with "
                                "{ref}`text <label>` (a (label)= target right before the cell)")
            elif asserts and not any(re.search(r"^\s*assert\b|\bassert_\w+\(", labels[label], re.M)
                                     for label in named):
                problems.append(f"{notebook}: markdown cell {i}: \"{words}\" says asserted, but the "
                                f"cell{'s' if len(named) > 1 else ''} {', '.join(named)} hold no assert")
    return problems


def typed_reference_problems(page: Path) -> list[str]:
    """A typed section number ("section 5", "(8.1, 8.2)", "in 3.8") instead of a {doc} link."""
    if page.suffix == ".ipynb":
        texts = [(f"markdown cell {i}", "".join(c.get("source", "")))
                 for i, c in enumerate(_cells(page)) if c.get("cell_type") == "markdown"]
    else:
        texts = [("text", page.read_text())]
    problems = []
    for where, text in texts:
        for match in _TYPED_REFERENCE.finditer(_prose(text)):
            problems.append(f"{page}: {where}: typed section number {match.group(0)!r}; "
                            "link the page with {doc}`../chN_x/NN_page` instead")
    return problems


def prose_problems(pages: list[Path], root: Path) -> list[str]:
    """Claims and typed references on ``pages``, with cell labels taken from every notebook."""
    labels: dict[str, str] = {}
    problems = []
    seen: dict[str, Path] = {}
    for notebook in sorted((root / "notebooks").rglob("*.ipynb")):
        for label in cell_labels(notebook):
            if label in seen:  # Sphinx would link one of the two; the check would read the other
                problems.append(f"{notebook}: cell label {label!r} is also set in {seen[label]}")
            seen[label] = notebook
        labels.update(cell_labels(notebook))
    for page in pages:
        problems += typed_reference_problems(page)
        problems += claim_problems(page, labels)
    return problems


if __name__ == "__main__":  # python tools/check_book.py notebooks/ch3_ddp/*.ipynb: the prose checks
    import sys

    found = prose_problems([Path(p) for p in sys.argv[1:]], Path(__file__).resolve().parents[1])
    print("\n".join(found) or "no problems")
    sys.exit(1 if found else 0)
