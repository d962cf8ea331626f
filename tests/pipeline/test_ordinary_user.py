"""The book as a reader without root runs it: an ordinary user, made here, with an ordinary user's
PATH (no sbin), builds the cluster lab, runs a job across its two nodes, a Slurm job, and 3.3's
forensics (py-spy on every rank of a hung job).

The suite's Python may live where an ordinary user cannot go (pyenv in root's home, mode 700); the
user then sees it through a private mount, as they would see a Python an administrator installed.
Run by an ordinary user, the whole suite already is this test, and it says so instead.
"""

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support import REPO

USER = "dtbook-reader"
USER_PATH = "/usr/local/bin:/usr/bin:/bin"  # Debian's default for a user: no sbin

# Run as the user, in a copy of the book they own: each part prints one JSON line.
DRIVER = r"""
import json, os, re, subprocess, sys, threading, time
from pathlib import Path

from dtbook.cluster_lab import ClusterLab
from dtbook.launch import launch_torchrun, launch_torchrun_nodes
from dtbook.metrics import read_metrics
from dtbook.slurm_lab import SlurmLab

def say(**record):
    print(json.dumps(record), flush=True)

say(part="who", uid=os.getuid(), path=os.environ["PATH"])

with ClusterLab(nodes=2, rate_gbit=1.0) as lab:
    check = launch_torchrun_nodes("ch5_cluster_check.py", ["--timeout", 30], lab=lab,
                                  quiet=True, timeout=300, check=False)
    say(part="job", returncodes=check.returncodes, output=check.output[-3000:])
    with SlurmLab(lab, quiet=True) as slurm:
        tasks = slurm.run("srun", "-N2", "sh", "-c",
                          'echo "$(hostname) $(id -u) $(readlink /proc/self/ns/net)"', show=False)
        say(part="slurm", tasks=sorted(tasks.stdout.split("\n")[:-1]),
            namespaces=[f"net:[{lab.netns_inode(n.index)}]" for n in lab.nodes])
    slurm_left = slurm.leftovers()
say(part="leftovers", left=slurm_left + lab.leftovers())

work = Path(sys.argv[1])
metrics, dumps = work / "hang.jsonl", work / "fr"
dumps.mkdir()
result = {}
hung = threading.Thread(target=lambda: result.update(run=launch_torchrun(
    "ch3_hang_forensics.py", ["--extra-on-rank", 0, "--steps", 2, "--timeout", 8, "--metrics", metrics],
    nproc=2, env={"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": str(dumps / "rank_")},
    metrics=False, check=False, quiet=True, timeout=300)))
hung.start()
deadline = time.monotonic() + 120
while not any(r.get("event") == "diverging" for r in read_metrics(metrics)) and time.monotonic() < deadline:
    time.sleep(0.1)
pids = next(r["pids"] for r in read_metrics(metrics) if r.get("event") == "pids")
py_spy = str(Path(sys.executable).with_name("py-spy"))
stacks = {}
while len(stacks) < len(pids) and time.monotonic() < deadline:
    for pid in pids:
        out = re.sub(r"\x1b\[[0-9;]*m", "", subprocess.run([py_spy, "dump", "--pid", str(pid)],
                                                           capture_output=True, text=True).stdout)
        frames = [line.split()[0] for line in out.splitlines() if line.startswith("    ")]
        if frames[:1] in (["all_reduce"], ["barrier"]):
            stacks[pid] = frames[0]
    time.sleep(0.2)
control = subprocess.run([py_spy, "dump", "--pid", "1"], capture_output=True, text=True)
hung.join()
say(part="forensics", stacks=[stacks.get(pid) for pid in pids], returncode=result["run"].returncode,
    dumps=sorted(p.name for p in dumps.iterdir()), control=control.returncode,
    control_says=(control.stdout + control.stderr).strip()[-200:])
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="this suite runs as an ordinary user already: "
                                "the lab and Slurm tests of tests/ch5 ran as one")


def ensure_user() -> pwd.struct_passwd:
    """The ordinary user, with the id ranges newuidmap maps for it (as adduser gives every user)."""
    try:
        user = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", USER], check=True)
        user = pwd.getpwnam(USER)
    for ids in ("/etc/subuid", "/etc/subgid"):
        if not any(line.startswith(f"{USER}:") for line in Path(ids).read_text().splitlines()):
            flag = "--add-subuids" if ids.endswith("uid") else "--add-subgids"
            subprocess.run(["usermod", flag, "300000-365535", USER], check=True)
    return user


def hidden_ancestors(paths: list[str]) -> dict[Path, set[Path]]:
    """For each path, its first ancestor others cannot enter, and the child on the way to the path."""
    hidden: dict[Path, set[Path]] = {}
    for path in paths:
        parts = Path(path).resolve().parts
        for depth in range(2, len(parts)):
            folder = Path(*parts[:depth])
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                hidden.setdefault(folder, set()).add(Path(*parts[:depth + 1]))
                break
    return hidden


def shown_to_others(hidden: dict[Path, set[Path]], parking: Path) -> str:
    """Shell lines, run as root in a private mount namespace, that let others reach the paths:
    each hidden folder is covered by an empty, open tmpfs with just the needed children bound in."""
    lines = []
    for n, (folder, children) in enumerate(sorted(hidden.items())):
        for k, child in enumerate(sorted(children)):
            lines.append(f"mkdir -p {parking}/{n}-{k} && mount --bind {child} {parking}/{n}-{k}")
        lines.append(f"mount -t tmpfs -o mode=755 dtbook-open {folder}")
        for k, child in enumerate(sorted(children)):
            lines.append(f"mkdir -p {child} && mount --bind {parking}/{n}-{k} {child}")
    return "\n".join(lines)


def test_an_ordinary_user_runs_the_lab_a_job_across_it_slurm_and_the_hang_forensics():
    user = ensure_user()
    work = Path(tempfile.mkdtemp(prefix="dtbook-ordinary-user-"))
    try:
        book = work / "book"
        ignore = shutil.ignore_patterns("__pycache__", "runs")
        for part in ("scripts", "tests"):
            shutil.copytree(REPO / part, book / part, ignore=ignore)
        (work / "hang").mkdir()
        for path in [work, *work.rglob("*")]:
            os.chown(path, user.pw_uid, user.pw_gid)
        work.chmod(0o755)
        env = ["env", "-i", f"HOME={user.pw_dir}", f"USER={USER}", f"PATH={USER_PATH}", "LANG=C.UTF-8",
               f"PYTHONPATH={book / 'scripts'}"]
        as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", *env,
                   sys.executable, "-c", DRIVER, str(work / "hang")]
        hidden = hidden_ancestors([sys.executable, sys.prefix])
        script = shown_to_others(hidden, work / "parking") + '\nexec "$@"'
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                               *as_user], cwd=book, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    records = {r["part"]: r for r in map(json.loads, (line for line in done.stdout.splitlines()
                                                       if line.startswith("{")))}
    assert done.returncode == 0 and "forensics" in records, done.stdout[-3000:] + done.stderr[-3000:]

    who = records["who"]
    assert who["uid"] == user.pw_uid != 0 and "sbin" not in who["path"]
    job = records["job"]
    assert job["returncodes"] == [0, 0], job["output"]
    assert "node0" in job["output"] and "node1" in job["output"]
    slurm = records["slurm"]
    # Each task on its own node, in that node's namespace, as the lab host's root (the user's uid).
    assert [task.split() for task in slurm["tasks"]] == [
        [f"node{k}", "0", ns] for k, ns in enumerate(slurm["namespaces"])]
    assert records["leftovers"]["left"] == []
    forensics = records["forensics"]
    assert forensics["stacks"] == ["all_reduce", "barrier"]  # py-spy read both ranks, as the user
    assert forensics["returncode"] != 0 and forensics["dumps"] == ["rank_0", "rank_1"]
    # The control: the same py-spy cannot read a process of root's, so the user really is ordinary.
    assert forensics["control"] != 0, forensics["control_says"]
