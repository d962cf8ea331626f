"""Print the executed book to one PDF, with the Chromium the browser check uses.

    python tools/build_pdf.py                  # after `make book`: _build/book/pdf/book.pdf
    python tools/build_pdf.py --book DIR       # a book that `build_book.py --out DIR` built

It executes nothing: it renders the notebooks that the book's build executed into its staging
copy (DIR/source). Sphinx's singlehtml builder puts every page on one HTML page (DIR/_build/
singlehtml), with execution off and every warning an error, as for the HTML book; Debian's
chromium, driven by Playwright (no `playwright install`, no network), loads it over local HTTP,
unfolds the code cells tagged hide-input, waits for MathJax and the images, and prints it, with
the headings as the PDF's bookmarks.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from build_book import BuildError, resolve_entry, toc_entries

REPO = Path(__file__).resolve().parent.parent

# Debian's chromium, and how it starts here and in the browser check (tests/pipeline/test_browser.py).
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",  # no network here: stop Chromium phoning home
    "--disable-component-update",
    "--disable-sync",
]

PAPER = {"A4": "210mm", "Letter": "8.5in"}  # the paper sizes offered, and their widths
MARGIN = {"top": "15mm", "bottom": "18mm", "left": "15mm", "right": "15mm"}  # the bottom holds the page number
FOOTER = ('<div style="font-size: 8px; width: 100%; text-align: center; color: #555;">'
          '<span class="pageNumber"></span> / <span class="totalPages"></span></div>')

# On paper nothing can be clicked open or scrolled. The text takes the paper's width at a book's
# size (14 px, 10.5 pt); code at 12 px holds 90 columns on A4, 87 in a folded cell (the book's
# listings keep within 85 and 83), and wraps rather than run off the page, as outputs and table
# cells do. Folded cells are printed open, without their "Hide code cell source" line. Each
# chapter starts a page. The theme keeps every code block, table and cell on one page, which left
# most of a page blank before a long one: here they break between lines or rows, never leaving
# fewer than 3 lines of code on either side.
PRINT_CSS = """
@media print {
  html { font-size: 14px !important; }
  .bd-main .bd-content { margin-left: 0 !important; }
  .bd-article { padding: 0 !important; }
  pre { font-size: 12px !important; white-space: pre-wrap !important; overflow-wrap: anywhere;
        overflow: visible !important; orphans: 3; widows: 3; }
  div.highlight, div[class*=highlight-], div.literal-block-wrapper, div.cell_output, .output,
  .admonition, details, table, .pst-scrollable-table-container {
    overflow: visible !important; break-inside: auto !important; }
  tr, img, svg, figure, mjx-container[display="true"] { break-inside: avoid; }
  table { font-size: 0.9em; }
  table td, table th { overflow-wrap: anywhere; }
  details.hide > summary, .headerlink, button.copybtn, .toggle-button { display: none !important; }
  h1, h2, h3, h4, .caption { break-after: avoid; }
  img { max-width: 100% !important; height: auto; }
  .pdf-chapter { break-before: page; }
}
"""

# Open every <details> (the hide-input cells, and dropdowns), load every image now (not when
# scrolled to), mark each chapter's first element, and make the links that Sphinx's singlehtml
# builder points at the root page's file (book/intro.html#label) point into this page. Code is
# printed in one colour but for its comments and docstrings: the PDF is tagged, for its outline
# (the headings as bookmarks), and every coloured token became an element of that structure,
# which made the file three times as large (27 MiB instead of 10 for the book's text alone).
PREPARE_JS = """([chapters, rootFile]) => {
    document.querySelectorAll('details').forEach(d => { d.open = true; });
    document.querySelectorAll('.toggle-hidden').forEach(e => e.classList.remove('toggle-hidden'));
    document.querySelectorAll('img[loading="lazy"]').forEach(i => { i.loading = 'eager'; });
    document.querySelectorAll('div.highlight pre').forEach(pre => {
        pre.querySelectorAll('span:not(.c, .c1, .ch, .cm, .cs, .sd)').forEach(t => t.replaceWith(...t.childNodes));
        pre.normalize();
    });
    // A chapter's page break goes on the outermost box that the chapter starts (a toctree's
    // wrapper), else Chromium may give that box's empty start a page of its own.
    const first = box => Array.from(box.children).find(c => !(c.tagName === 'SPAN' && !c.textContent));
    for (const doc of chapters) {
        const anchor = document.getElementById('document-' + doc);
        let start = anchor && anchor.nextElementSibling;
        while (start && start.parentElement.tagName !== 'ARTICLE' && first(start.parentElement) === start) {
            start = start.parentElement;
        }
        if (start) start.classList.add('pdf-chapter');
    }
    document.querySelectorAll('a[href^="' + rootFile + '#"]').forEach(a => {
        a.setAttribute('href', a.getAttribute('href').slice(rootFile.length));
    });
    return chapters.filter(doc => !document.getElementById('document-' + doc));
}"""

# Whatever would still be cut at the paper's width: code and output blocks, tables, images and
# displayed formulas that scroll or reach past the text, each as its kind and first words.
CUT_JS = """() => Array.from(document.querySelectorAll(
        'article pre, article table, article img, article mjx-container[display="true"]'))
    .filter(e => e.scrollWidth > e.clientWidth + 1
                 || e.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
    .map(e => e.tagName.toLowerCase() + ': '
              + (e.textContent || e.getAttribute('src') || '').replace(/\\s+/g, ' ').trim().slice(0, 60))"""

IMAGES_JS = """() => Promise.all(Array.from(document.images).map(i => i.decode().catch(() => null)))
    .then(() => Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src))"""

MATH_JS = """() => (window.MathJax && MathJax.startup ? MathJax.startup.promise : Promise.resolve())
    .then(() => [document.querySelectorAll('span.math, div.math').length,
                 document.querySelectorAll('mjx-container').length])"""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def chapter_files(toc_path: Path) -> list[str]:
    """The files _toc.yml lists as chapters (a part's chapters, or the top level's)."""
    toc = yaml.safe_load(toc_path.read_text())
    parts = toc.get("parts", [toc])
    return [chapter["file"] for part in parts for chapter in part.get("chapters", []) if "file" in chapter]


def check_built(book: Path) -> Path:
    """The staging copy of a built book, with every page of its table of contents executed."""
    source = book / "source"
    if not (source / "_toc.yml").is_file():
        raise BuildError(f"no built book in {book} (no source/_toc.yml): build it first with `make book`")
    missing = []
    for entry in toc_entries(source / "_toc.yml"):
        try:
            resolve_entry(entry, source)
        except BuildError:
            missing.append(entry)
    if missing:
        raise BuildError(f"the book in {book} lacks {len(missing)} page(s) of its _toc.yml ({missing[0]}, ...): "
                         f"build it with `make book`")
    return source


def build_single_page(book: Path) -> Path:
    """Sphinx's singlehtml builder over the executed staging copy; the page's path.

    Jupyter Book writes it beside the HTML book (DIR/_build/singlehtml) and shares its
    environment, so only the pages changed since the HTML build are read again.
    """
    source = book / "source"
    command = ["jupyter-book", "build", str(source), "--path-output", str(book), "--builder", "singlehtml",
               "--warningiserror", "--nitpick", "--keep-going", "--quiet"]
    jb = Path(sys.executable).with_name("jupyter-book")
    command[0] = str(jb) if jb.exists() else command[0]
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, cwd=book, stdout=subprocess.DEVNULL)
    if done.returncode != 0:
        raise BuildError(f"jupyter-book's singlehtml build failed (exit {done.returncode}); its warnings are above")
    # The builder writes the page as the root document (book/intro.html) but links its styles,
    # scripts and images relative to the output folder, and leaves a redirect as index.html:
    # the page itself belongs there.
    out = book / "_build" / "singlehtml"
    root = yaml.safe_load((source / "_toc.yml").read_text())["root"]
    page = out / "index.html"
    page.write_text((out / f"{root}.html").read_text())
    return page


def print_pdf(page: Path, pdf: Path, paper: str, chapters: list[str], root: str) -> list[str]:
    """Print the single page to ``pdf``; return the blocks that are still cut at the paper's width.

    Raises BuildError when an image does not load, a formula is not typeset, or the page
    asks for anything outside the book.
    """
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).is_file():
        raise BuildError(f"no chromium at {CHROMIUM}: install Debian's chromium (`make chromium`)")
    handler = functools.partial(QuietHandler, directory=str(page.parent))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    server = f"http://127.0.0.1:{httpd.server_address[1]}"
    outside, failed = [], []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            # A window as wide as the text on the paper, to measure what would be cut.
            width = round(_px(PAPER[paper]) - _px(MARGIN["left"]) - _px(MARGIN["right"]))
            context = browser.new_context(viewport={"width": width, "height": 1000}, color_scheme="light")

            def offline(route):
                if route.request.url.startswith(server.rstrip("/") + "/"):
                    route.continue_()
                else:
                    outside.append(route.request.url)
                    route.abort()

            context.route("**/*", offline)
            tab = context.new_page()
            tab.on("requestfailed", lambda r: _missing(r.url) and failed.append(r.url))
            tab.on("response", lambda r: r.status >= 400 and _missing(r.url) and failed.append(f"{r.status} {r.url}"))
            tab.goto(f"{server}/{page.name}", wait_until="load", timeout=120_000)
            tab.wait_for_load_state("networkidle", timeout=120_000)
            absent = tab.evaluate(PREPARE_JS, [chapters, f"{root}.html"])
            if absent:
                raise BuildError(f"the single page has no chapter {absent[0]!r}")
            broken = tab.evaluate(IMAGES_JS)
            formulas, typeset = tab.evaluate(MATH_JS)
            problems = [f"images that did not load: {broken}"] if broken else []
            if typeset < formulas:
                problems.append(f"{formulas} formulas on the page, {typeset} typeset by MathJax")
            if outside or failed:
                problems.append(f"the page asked for {outside + failed} (the PDF is made offline)")
            if problems:
                raise BuildError("; ".join(problems))
            tab.emulate_media(media="print")
            tab.add_style_tag(content=PRINT_CSS)
            cut = tab.evaluate(CUT_JS)
            tab.evaluate("() => document.fonts.ready.then(() => true)")  # MathJax's fonts, the theme's
            pdf.parent.mkdir(parents=True, exist_ok=True)
            # Chromium writes the outline (the headings as bookmarks) only into a tagged PDF.
            tab.pdf(path=str(pdf), format=paper, print_background=True, margin=MARGIN, outline=True, tagged=True,
                    display_header_footer=True, header_template="<div></div>", footer_template=FOOTER)
            browser.close()
    finally:
        httpd.shutdown()
    return cut


def _missing(url: str) -> bool:
    """Whether a failed request matters: singlehtml writes no search index, though its page links one."""
    return not url.endswith("/searchindex.js")


def _px(length: str) -> float:
    """A length in mm or in, in CSS pixels (96 to the inch)."""
    return float(length[:-2]) * 96 / (1.0 if length.endswith("in") else 25.4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--book", type=Path, default=REPO / "_build" / "book",
                        help="the folder build_book.py built (default: _build/book)")
    parser.add_argument("--out", type=Path, help="the PDF to write (default: BOOK/pdf/book.pdf)")
    parser.add_argument("--paper", choices=sorted(PAPER), default="A4", help="paper size (default A4)")
    args = parser.parse_args()
    book = args.book.resolve()
    pdf = (args.out or book / "pdf" / "book.pdf").resolve()
    start = time.perf_counter()
    try:
        source = check_built(book)
        page = build_single_page(book)
        root = yaml.safe_load((source / "_toc.yml").read_text())["root"]
        cut = print_pdf(page, pdf, args.paper, chapter_files(source / "_toc.yml"), root)
    except BuildError as err:
        print(f"build_pdf: error: {err}", file=sys.stderr)
        sys.exit(1)
    for block in cut:
        print(f"build_pdf: warning: wider than the paper, cut: {block}", file=sys.stderr)
    size = pdf.stat().st_size / 2**20
    print(f"\nThe PDF is at {pdf} ({size:.1f} MiB, {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
