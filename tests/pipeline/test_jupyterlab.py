"""The README's second way to read the book: JupyterLab, started as it says, runs a chapter's notebook.

The server is started headless from the venv, the notebook is opened through the server's contents
API, and its code cells run one after the other in a kernel the server starts for it, as a reader's
"Run all" does: with the notebook's own folder as the working directory.
"""

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests
import websocket

from dtbook.ports import free_port
from support import REPO

NOTEBOOK = "ch2_first_steps/01_first_distributed_program.ipynb"
CELL_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`jupyter lab notebooks/` with no browser, a token, and this machine's root allowed."""
    port, token = free_port(), uuid.uuid4().hex
    log = tmp_path_factory.mktemp("jupyterlab") / "server.log"
    jupyter = Path(sys.executable).with_name("jupyter")
    process = subprocess.Popen(
        [str(jupyter), "lab", "notebooks/", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", "--allow-root", "--ServerApp.open_browser=False"],
        cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"token {token}"}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{base}/api/status", headers=headers, timeout=2).ok:
                break
        except requests.ConnectionError:
            time.sleep(0.5)
    else:
        process.kill()
        pytest.fail(f"JupyterLab did not answer within 60 s:\n{log.read_text()[-2000:]}")
    yield base, headers, port, token
    process.terminate()
    process.wait(timeout=30)


def execute(ws, session: str, code: str) -> tuple[str, str]:
    """Run one cell in the kernel; return its reply status and everything it printed."""
    msg_id = uuid.uuid4().hex
    ws.send(json.dumps({
        "header": {"msg_id": msg_id, "username": "reader", "session": session, "msg_type": "execute_request",
                   "version": "5.3"},
        "parent_header": {}, "metadata": {}, "channel": "shell",
        "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True}}))
    printed, status, idle = [], None, False
    deadline = time.monotonic() + CELL_TIMEOUT_S
    while status is None or not idle:
        assert time.monotonic() < deadline, f"the cell did not finish within {CELL_TIMEOUT_S} s"
        message = json.loads(ws.recv())
        if message.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = message["msg_type"], message["content"]
        if kind == "stream":
            printed.append(content["text"])
        elif kind == "error":
            printed.append(f"{content['ename']}: {content['evalue']}")
        elif kind == "execute_reply":
            status = content["status"]
        elif kind == "status" and content["execution_state"] == "idle":
            idle = True  # everything the cell printed has arrived
    return status, "".join(printed)


def test_jupyterlab_opens_a_chapter_and_runs_it_in_the_notebooks_folder(server):
    base, headers, port, token = server
    notebook = requests.get(f"{base}/api/contents/{NOTEBOOK}", headers=headers, timeout=30).json()
    assert notebook["type"] == "notebook"
    cells = [c for c in notebook["content"]["cells"] if c["cell_type"] == "code"]
    session = requests.post(f"{base}/api/sessions", headers=headers, timeout=60, json={
        "path": NOTEBOOK, "type": "notebook", "name": NOTEBOOK, "kernel": {"name": "python3"}}).json()
    kernel = session["kernel"]["id"]
    ws = websocket.create_connection(f"ws://127.0.0.1:{port}/api/kernels/{kernel}/channels?token={token}",
                                     timeout=CELL_TIMEOUT_S)
    try:
        client = uuid.uuid4().hex
        status, cwd = execute(ws, client, "import os; print(os.getcwd())")
        assert status == "ok" and Path(cwd.strip()) == REPO / "notebooks" / Path(NOTEBOOK).parent
        printed = []
        for index, cell in enumerate(cells):
            status, text = execute(ws, client, "".join(cell["source"]))
            assert status == "ok", f"code cell {index + 1} failed in JupyterLab's kernel:\n{text[-2000:]}"
            printed.append(text)
        assert "all_reduce result on every rank" in "".join(printed)  # the page's run, not a stub
        # The control: a failing cell is reported as one, so the loop above could have failed.
        status, text = execute(ws, client, "assert False, 'a reader sees this'")
        assert status == "error" and "a reader sees this" in text
    finally:
        ws.close()
        requests.delete(f"{base}/api/sessions/{session['id']}", headers=headers, timeout=30)
