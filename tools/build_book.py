"""Execute every notebook in _toc.yml with papermill, then build the HTML book.

    python tools/build_book.py                 # the book, into _build/book
    python tools/build_book.py --jobs 2        # two notebooks side by side (what `make test` does)

There is one configuration: each notebook runs with the parameters in its first cell, the values a
reader gets, and the tests check the book this builds (the same folder, the same fingerprints).

Notebook sources in git carry no outputs. Each one is executed into a staging
copy of the book, with its own folder as the working directory, and Jupyter
Book builds the HTML from that copy with execution switched off and every
warning treated as an error. A notebook is executed again only when its source, the
book's library (scripts/dtbook), a companion script it names, or a script
it launched the last time it ran has changed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import yaml

from dtbook.launch import LAUNCH_LOG_VARIABLE  # each launch appends the script's name to this file
from dtbook.plots import DOWNLOADS_DIR  # the files pages offer for download

REPO = Path(__file__).resolve().parent.parent
STAGED_TOP_LEVEL = ["_config.yml", "_toc.yml", "book", "scripts"]  # scripts: for literalinclude listings
LIBRARY = "dtbook"  # scripts/dtbook: every notebook depends on all of it


class BuildError(Exception):
    pass


class NotExecutable(BuildError):
    """A notebook that cannot run on this machine (its set-up cell says why): the cluster lab's
    sections without root or user namespaces, or without Slurm. The rest of the book still builds."""


# What a section's set-up cell raises when this machine cannot run it (dtbook.cluster_lab's
# require_lab and require_slurm). Raised by any later cell, it is a failure like any other.
UNAVAILABLE = "LabUnavailable"
SETUP_CELL = 1  # the code cell after the parameters (check_book.source_problems checks the call)


def setup_cell_source(notebook: Path) -> str | None:
    """The source of the notebook's set-up cell."""
    code = [cell for cell in json.loads(notebook.read_text())["cells"] if cell["cell_type"] == "code"]
    return "".join(code[SETUP_CELL]["source"]) if len(code) > SETUP_CELL else None


def toc_entries(toc_path: Path) -> list[str]:
    """Every ``root`` and ``file`` entry of a Jupyter Book table of contents, in order."""
    toc = yaml.safe_load(toc_path.read_text())
    entries = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                entries.append(node["file"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk({k: v for k, v in toc.items() if k != "root"})
    return entries


def resolve_entry(entry: str, root: Path) -> Path:
    base = root / entry
    for candidate in (base, base.with_suffix(".ipynb"), base.with_suffix(".md")):
        if candidate.is_file():
            return candidate
    raise BuildError(f"_toc.yml names {entry!r}, but neither {entry}.ipynb nor {entry}.md exists")


def toc_notebooks(root: Path) -> list[Path]:
    return [p for p in (resolve_entry(e, root) for e in toc_entries(root / "_toc.yml")) if p.suffix == ".ipynb"]


def notebook_dependencies(notebook: Path, scripts: Path, launched: list[str]) -> list[Path]:
    """The files an executed notebook's outputs depend on, besides the notebook itself.

    The whole book library (``scripts/dtbook``), every script or file under ``scripts/`` whose name
    the notebook mentions, and every script the notebook's last execution actually launched, which
    catches a script launched under a computed name.
    """
    text = notebook.read_text()
    files = [p for p in scripts.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    library = {p for p in files if p.relative_to(scripts).parts[0] == LIBRARY}
    named = {p for p in files if p.name in text}
    ran = {scripts / name for name in launched if (scripts / name).is_file()}
    return sorted(library | named | ran)


def fingerprint(notebook: Path, scripts: Path, launched: list[str]) -> str:
    """Hash of what an executed notebook depends on: itself, the library and its scripts."""
    digest = hashlib.sha256(notebook.read_bytes())
    for path in notebook_dependencies(notebook, scripts, launched):
        digest.update(path.relative_to(scripts).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def execute(notebook: Path, target: Path, cell_timeout: int, root: Path) -> None:
    import papermill
    from papermill.exceptions import PapermillExecutionError

    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        papermill.execute_notebook(
            str(notebook),
            str(target),
            kernel_name="python3",
            cwd=str(notebook.parent),
            execution_timeout=cell_timeout,
            progress_bar=False,
            log_output=False,
            # The kernel logs a warning about unencrypted local TCP at every start; errors still show.
            extra_arguments=["--IPKernelApp.log_level=ERROR"],
        )
    except PapermillExecutionError as err:
        # Known by its source: papermill's injected cells shift the indices.
        if err.ename == UNAVAILABLE and err.source == setup_cell_source(notebook):
            raise NotExecutable(" ".join(err.evalue.split())) from None
        raise BuildError(
            f"{notebook.relative_to(root)}: cell {err.exec_count} raised {err.ename}: {err.evalue.strip()}\n"
            f"  (the executed copy with the traceback is {target})"
        ) from None
    except Exception as err:  # kernel death, cell timeout
        message = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise BuildError(f"{notebook.relative_to(root)}: execution failed: {type(err).__name__}: {message}") from None


def stage_and_execute(
    root: Path, out: Path, cell_timeout: int, force: bool, jobs: int
) -> tuple[list[tuple[str, str, float]], dict[str, str]]:
    staging = out / "source"
    staging.mkdir(parents=True, exist_ok=True)
    for name in STAGED_TOP_LEVEL:
        src, dst = root / name, staging / name
        if src.is_dir():
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)

    stage_mathjax(staging)

    stamps_path = out / "fingerprints.json"
    stamps = json.loads(stamps_path.read_text()) if stamps_path.exists() else {}
    report: dict[str, tuple[str, str, float]] = {}
    pending = []
    for notebook in toc_notebooks(root):
        rel = notebook.relative_to(root).as_posix()
        previous = stamps.get(rel) if isinstance(stamps.get(rel), dict) else {}
        stamp = fingerprint(notebook, root / "scripts", previous.get("launched", []))
        if not force and previous.get("stamp") == stamp and (staging / rel).exists():
            report[rel] = (rel, "skipped (unchanged)", 0.0)
        else:
            stamps.pop(rel, None)
            pending.append(notebook)
    stamps_path.write_text(json.dumps(stamps, indent=1))

    # Notebooks are independent (each writes under its own runs/ folder, labs take free slots),
    # and much of a notebook's time is spent waiting: for torchrun's start, a rendezvous, a
    # timeout it demonstrates. A second notebook fills those waits.
    failure = None
    not_executed: dict[str, str] = {}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        running = {pool.submit(execute_recording_launches, notebook, staging / rel_of(notebook, root),
                               cell_timeout, root, out): notebook for notebook in pending}
        for done in as_completed(running):
            if done.cancelled():
                continue
            notebook = running[done]
            rel = rel_of(notebook, root)
            try:
                launched, seconds = done.result()
            except NotExecutable as err:
                print(f"not executed {rel}: {err}", flush=True)
                stage_unexecuted(notebook, staging / rel, str(err))
                report[rel] = (rel, "not executed", 0.0)
                not_executed[rel] = str(err)
                continue
            except BuildError as err:
                failure = failure or err
                for future in running:
                    future.cancel()  # a failed build stops; what already runs finishes
                continue
            print(f"executed {rel} in {seconds:.1f} s", flush=True)
            report[rel] = (rel, "executed", seconds)
            stamps[rel] = {"stamp": fingerprint(notebook, root / "scripts", launched),
                           "launched": launched}
            stamps_path.write_text(json.dumps(stamps, indent=1))
    if failure:
        raise failure
    stage_downloads(staging)
    return [report[rel_of(notebook, root)] for notebook in toc_notebooks(root)], not_executed


def stage_downloads(staging: Path) -> None:
    """The files pages offer for download (``dtbook.plots.download_role``), where their roles look.

    A page links a trace as ``/runs/downloads/<name>`` instead of inlining it; Sphinx copies each
    linked file beside the HTML, and fails the build (``-W``) on one that is missing.
    """
    if DOWNLOADS_DIR.is_dir():
        shutil.copytree(DOWNLOADS_DIR, staging / "runs" / "downloads", dirs_exist_ok=True)


def stage_unexecuted(notebook: Path, target: Path, reason: str) -> None:
    """The page of a section this machine cannot run: its source, opened by a note that says why."""
    source = json.loads(notebook.read_text())
    note = {"cell_type": "markdown", "id": "not-executed", "metadata": {},
            "source": ["```{warning}\n", f"This section was not executed when this copy of the book was built: "
                       f"{reason}\n", "```\n"]}
    cells = source["cells"]
    cells.insert(1 if cells and cells[0]["cell_type"] == "markdown" else 0, note)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(source, indent=1))


def rel_of(notebook: Path, root: Path) -> str:
    return notebook.relative_to(root).as_posix()


def execute_recording_launches(notebook: Path, target: Path, cell_timeout: int, root: Path,
                               out: Path) -> tuple[list[str], float]:
    """Execute the notebook (in a worker process of its own); return the scripts (relative to
    scripts/) that it launched, and the seconds it took."""
    log = out / "launches" / (rel_of(notebook, root).replace("/", "__") + ".txt")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    os.environ[LAUNCH_LOG_VARIABLE] = str(log)  # the kernel, and so the launcher, inherit it
    start = time.perf_counter()
    execute(notebook, target, cell_timeout, root)
    return (sorted(set(log.read_text().split())) if log.exists() else []), time.perf_counter() - start


def stage_mathjax(staging: Path) -> None:
    """Ship MathJax inside the book, so formulas render without a network (see _config.yml).

    The `mathjax` package (django-static-mathjax on PyPI) is MathJax 3 as plain files; we copy the
    one bundle the book loads and the fonts it fetches relative to itself.
    """
    import mathjax

    es5 = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    target = staging / "_mathjax" / "mathjax"
    fonts = Path("output") / "chtml" / "fonts" / "woff-v2"
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy2(es5 / "tex-mml-chtml.js", target)
    shutil.copytree(es5 / fonts, target / fonts, dirs_exist_ok=True)


def build_html(out: Path) -> Path:
    command = ["jupyter-book", "build", str(out / "source"), "--path-output", str(out),
               "--warningiserror", "--nitpick", "--keep-going"]
    jb = Path(sys.executable).with_name("jupyter-book")
    command[0] = str(jb) if jb.exists() else command[0]
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, cwd=out)
    if done.returncode != 0:
        raise BuildError(f"jupyter-book build failed (exit {done.returncode}); its warnings are above")
    return out / "_build" / "html" / "index.html"


def print_table(report: list[tuple[str, str, float]], not_executed: dict[str, str]) -> None:
    width = max(len(r[0]) for r in report)
    print(f"\n{'notebook'.ljust(width)}  {'status':<20}  seconds")
    for rel, status, seconds in report:
        shown = f"{seconds:7.1f}" if seconds else f"{'-':>7}"
        print(f"{rel.ljust(width)}  {status:<20}  {shown}")
    print(f"{'total'.ljust(width)}  {'':<20}  {sum(r[2] for r in report):7.1f}\n")
    if not_executed:
        print(f"not executed on this machine ({len(not_executed)}); their pages say why:")
        for rel, reason in not_executed.items():
            print(f"  {rel}: {reason}")
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="output folder (default: _build/book)")
    parser.add_argument("--force", action="store_true", help="re-execute every notebook, changed or not")
    parser.add_argument("--cell-timeout", type=int, default=600, help="seconds one cell may run (default 600)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="notebooks executed side by side (default 1: the book's timings see no neighbour)")
    parser.add_argument("--no-html", action="store_true", help="execute the notebooks only")
    parser.add_argument("--root", type=Path, default=REPO, help="the book's source folder (default: this repository)")
    args = parser.parse_args()
    root = args.root.resolve()
    out = (args.out or root / "_build" / "book").resolve()
    try:
        if not (root / "_toc.yml").is_file():
            raise BuildError(f"no _toc.yml in {root}")
        report, not_executed = stage_and_execute(root, out, args.cell_timeout, args.force, args.jobs)
        print_table(report, not_executed)
        if not args.no_html:
            index = build_html(out)
            print(f"\nThe book is at {index}")
    except BuildError as err:
        print(f"build_book: error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
