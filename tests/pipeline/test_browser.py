"""Open every page of the built book in a real headless Chromium, served over local HTTP."""

import functools
import http.server
import threading
from urllib.parse import urljoin

import pytest

from build_book import resolve_entry, toc_entries
from build_pdf import CHROMIUM, CHROMIUM_ARGS  # Debian's chromium, and how both checks start it
from support import REPO

# Console messages the theme is known to emit that say nothing about our pages. Keep this short.
KNOWN_CONSOLE_NOISE = (
    # sphinx-thebe 0.3.1 adds its inline config script twice per page under jupyter-book 1.0.4;
    # the second `const` declaration fails. Thebe (live code) is not used by this book.
    "Identifier 'THEBE_JS_URL' has already been declared",
    # pydata-sphinx-theme finds no saved light/dark choice in a fresh browser profile and says so.
    "Got invalid theme mode",
)

# The window a reader on a laptop has: code shown on a page must fit it without scrolling.
VIEWPORT = {"width": 1366, "height": 768}

# Every code block a reader sees (cell inputs, listings, fenced code), not cell outputs; each as
# its caption, its first line, and how much wider its content is than its box.
WIDE_CODE_JS = """() => Array.from(document.querySelectorAll('div.highlight pre'))
    .filter(pre => !pre.closest('.cell_output'))
    .filter(pre => pre.scrollWidth > pre.clientWidth + 1)
    .map(pre => ({
        caption: pre.closest('.literal-block-wrapper')?.querySelector('.caption-text')?.innerText ?? '',
        first: (pre.textContent.split('\\n').find(line => line.trim()) ?? '').slice(0, 70),
        overflow: pre.scrollWidth - pre.clientWidth}))"""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server(book):
    html = book / "_build" / "html"
    handler = functools.partial(QuietHandler, directory=str(html))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.mark.parametrize("entry", toc_entries(REPO / "_toc.yml"))
def test_page_renders_in_a_browser(server, browser, entry):
    page = browser.new_page(viewport=VIEWPORT)
    console_errors, failed, external = [], [], []
    page.on("console", lambda m: m.type == "error" and console_errors.append(m.text))
    page.on("pageerror", lambda e: console_errors.append(str(e)))
    page.on("request", lambda r: r.url.startswith((server, "data:")) or external.append(r.url))
    page.on("requestfailed", lambda r: failed.append(r.url))
    page.on("response", lambda r: r.url.startswith(server) and r.status >= 400 and failed.append(f"{r.status} {r.url}"))

    response = page.goto(f"{server}/{entry}.html", wait_until="load")
    assert response is not None and response.ok
    page.wait_for_load_state("networkidle")

    assert page.locator("main h1").first.inner_text().strip(), "the page has no heading"
    broken = page.evaluate(
        "Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)"
    )
    assert broken == [], f"images that did not load: {broken}"
    assert failed == [], f"requests that failed: {failed}"
    assert external == [], f"the book must read offline, but the page fetched {external}"
    formulas = page.locator("span.math, div.math").count()
    typeset = page.evaluate("() => window.MathJax ? MathJax.startup.promise.then("
                            "() => document.querySelectorAll('mjx-container').length) : 0")
    assert typeset >= formulas, f"{formulas} formulas on the page, {typeset} typeset by MathJax"
    unexpected = [m for m in console_errors if not any(n in m for n in KNOWN_CONSOLE_NOISE)]
    assert unexpected == [], f"console errors: {unexpected}"
    wide = page.evaluate(WIDE_CODE_JS)
    assert wide == [], f"code wider than the page at {VIEWPORT['width']} px: {wide}"
    if resolve_entry(entry, REPO).suffix == ".ipynb":
        # The download button offers the executed notebook, for a reader's JupyterLab.
        link = page.locator("a.btn-download-source-button").first.get_attribute("href")
        assert link.endswith(".ipynb"), link
        notebook = page.request.get(urljoin(page.url, link))
        assert notebook.ok and any(cell.get("outputs") for cell in notebook.json()["cells"])
    page.close()
