"""The book as a reader without root runs it: an ordinary user, made here, with an ordinary user's
PATH (no sbin), builds the cluster lab, runs a job across its two nodes, a Slurm job, and 3.3's
forensics (py-spy on every rank of a hung job); a lab with Slurm whose owner is killed outright
leaves no process behind. /run is an empty tmpfs for the user, as on a machine where no one has
made /run/netns yet, so the lab host takes the branch a fresh machine takes.

The suite's Python may live where an ordinary user cannot go (pyenv in root's home, mode 700); the
user then sees it through a private mount, as they would see a Python an administrator installed.
Run by an ordinary user, the whole suite already is this test, and it says so instead.
"""

import json
import os
import pwd
import shlex
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

# An owner with a lab and Slurm up, killed outright: its lab host must end every process it had.
owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
host_pid, userns = owner.stdout.readline().split()
members = lambda: [p.name for p in Path("/proc").glob("[0-9]*")
                   if os.path.exists(p / "ns" / "user") and os.readlink(p / "ns" / "user") == userns]
before = len(members())
owner.kill()
owner.wait()
deadline = time.monotonic() + 30
while (members() or os.path.exists(f"/proc/{host_pid}")) and time.monotonic() < deadline:
    time.sleep(0.1)
say(part="killed", before=before, after=members(), host_alive=os.path.exists(f"/proc/{host_pid}"))

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
control = subprocess.run([py_spy, "dump", "--pid", sys.argv[2]], capture_output=True, text=True)
hung.join()
say(part="forensics", stacks=[stacks.get(pid) for pid in pids], returncode=result["run"].returncode,
    dumps=sorted(p.name for p in dumps.iterdir()), control=control.returncode,
    control_says=(control.stdout + control.stderr).strip()[-200:])
"""

OWNER = """
import os, time
from dtbook.cluster_lab import ClusterLab, LabHost
from dtbook.slurm_lab import SlurmLab
lab = ClusterLab(nodes=2).up()
SlurmLab(lab, quiet=True).up()
lab.popen(1, ["sleep", "600"])
host = LabHost.get().proc.pid
print(host, os.readlink(f"/proc/{host}/ns/user"), flush=True)
time.sleep(600)
"""
DRIVER = DRIVER.replace("OWNER", repr(OWNER))

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="this suite runs as an ordinary user already: "
                                "the lab and Slurm tests of tests/ch5 ran as one")


def ensure_user() -> pwd.struct_passwd:
    """The ordinary user, with the id ranges newuidmap maps for it (as adduser gives every user)."""
    try:
        user = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", USER], check=True)
        user = pwd.getpwnam(USER)
    for ids in (Path("/etc/subuid"), Path("/etc/subgid")):
        ranges = [line.split(":") for line in (ids.read_text().splitlines() if ids.exists() else [])]
        if not any(fields[0] == USER for fields in ranges):
            start = max([100000] + [int(f[1]) + int(f[2]) for f in ranges if len(f) == 3])  # after all others
            flag = "--add-subuids" if ids.name == "subuid" else "--add-subgids"
            subprocess.run(["usermod", flag, f"{start}-{start + 65535}", USER], check=True)
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
            park, child = shlex.quote(f"{parking}/{n}-{k}"), shlex.quote(str(child))
            lines.append(f"mkdir -p {park} && mount --bind {child} {park}")
        lines.append(f"mount -t tmpfs -o mode=755 dtbook-open {shlex.quote(str(folder))}")
        for k, child in enumerate(sorted(children)):
            park, child = shlex.quote(f"{parking}/{n}-{k}"), shlex.quote(str(child))
            lines.append(f"mkdir -p {child} && mount --bind {park} {child}")
    # A machine where no one made /run/netns yet: the branch a reader's fresh machine takes.
    lines.append("mount -t tmpfs -o mode=755 dtbook-empty-run /run")
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
        # The control for py-spy: a Python process of root's, which root's py-spy reads and the user's must not.
        roots = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", *env,
                   sys.executable, "-c", DRIVER, str(work / "hang"), str(roots.pid)]
        hidden = hidden_ancestors([sys.executable, sys.prefix])
        script = shown_to_others(hidden, work / "parking") + '\nexec "$@"'
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                               *as_user], cwd=book, capture_output=True, text=True, timeout=600)
        py_spy = str(Path(sys.executable).with_name("py-spy"))  # long after the sleeper started
        as_root = subprocess.run([py_spy, "dump", "--pid", str(roots.pid)], capture_output=True, text=True)
        roots.kill()
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
    killed = records["killed"]
    # munged, slurmctld, two slurmds, the sleeper: all in the lab host's user namespace, then none.
    assert killed["before"] >= 5 and killed["after"] == [] and not killed["host_alive"], killed
    forensics = records["forensics"]
    assert forensics["stacks"] == ["all_reduce", "barrier"]  # py-spy read both ranks, as the user
    assert forensics["returncode"] != 0 and forensics["dumps"] == ["rank_0", "rank_1"]
    # The control: the same py-spy cannot read a process of root's, which root's py-spy can.
    assert as_root.returncode == 0 and "<module> (<string>:1)" in as_root.stdout, as_root.stdout
    assert forensics["control"] != 0 and "ermission" in forensics["control_says"], forensics["control_says"]
