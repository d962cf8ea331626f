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
    kernel = nb.get("metadata", {}).get("kernelspec", {}).get("name")
    if kernel != "python3":
        problems.append(f"{notebook}: kernelspec is {kernel!r}, expected 'python3'")
    problems += [f"{notebook}: {p}" for p in _lab_problems(["".join(c.get("source", "")) for c in code_cells])]
    return problems


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
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img" and attrs.get("src"):
            self.images.append(attrs["src"])
        self._in_title = tag == "title"

    def handle_data(self, data):
        if self._in_title:
            self.title += data

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False


def html_problems(html_dir: Path, entries: list[str]) -> list[str]:
    """Every table-of-contents entry has a page, and every local image a page shows exists."""
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
