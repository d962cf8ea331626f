"""Slurm on the cluster lab: munge, a controller on the host, one slurmd per lab node.

    with ClusterLab(nodes=2) as lab, SlurmLab(lab) as slurm:
        slurm.run("sinfo")
        job = slurm.submit("scripts/slurm/ch3_train.sbatch", options=["--gpus-per-node=0"])
        slurm.wait(job)

The daemons are Debian's ``slurm-wlm`` (``make slurm`` installs it) and run as root (an ordinary
user's root of the lab host, see ``dtbook.cluster_lab``) with
everything in the lab's own folder: a fresh munge key and socket, the configuration, state,
spool directories and logs. ``slurmctld`` listens on the host's address on the lab's switch;
each ``slurmd`` runs *on* its node (the node's network, host name and /etc/hosts), registers
under that host name with the node's address, and so jobs run inside the nodes exactly as
they would on separate machines. ``down()`` cancels jobs and stops every daemon and job
process, also at exit. This module does not import torch.
"""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dtbook.cluster_lab import (
    ClusterLab,
    LabError,
    LabHost,
    LabUnavailable,
    host_prefix,
    install_hint,
    lab_problem,
    missing_packages,
    require_lab,
)
from dtbook.paths import REPO_ROOT

DAEMONS = {"slurmctld": "slurmctld", "slurmd": "slurmd", "munged": "munge", "mungekey": "munge"}
CLIENTS = {"sbatch": "slurm-client", "srun": "slurm-client", "squeue": "slurm-client",
           "scontrol": "slurm-client", "scancel": "slurm-client", "sinfo": "slurm-client"}
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}

SLURM_CONF = """\
# The cluster lab's Slurm: written by dtbook.slurm_lab, removed with the lab.
ClusterName=dtbook-lab{slot}
# Every lab starts with an empty state; job ids that differ from any earlier lab's, and from
# those of a lab in another slot running beside it, keep the job file's per-job paths
# (runs/slurm/ckpt-<job id>) apart, as on a real cluster.
FirstJobId={first_job_id}
SlurmctldHost={host}({host_address})
SlurmctldPort={ctld_port}
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket={dir}/munge/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmctldPidFile={dir}/slurmctld.pid
SlurmctldLogFile={dir}/slurmctld.log
# %n is the node's name: every slurmd has its own spool, pid file and log.
SlurmdSpoolDir={dir}/spool-%n
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmdLogFile={dir}/slurmd-%n.log
# No cgroups: the nodes share one kernel. Processes are tracked through their parents.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# No accounting database (slurmdbd), so no sacct; finished jobs go to a text file and stay
# visible to `scontrol show job` for MinJobAge seconds.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.txt
MinJobAge=600
# How long a job's processes have between SIGTERM and SIGKILL (Slurm's default).
KillWait=30
{nodes}
PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def first_job_id(slot: int, now: float) -> int:
    """Each slot numbers its jobs in its own range of 8 million ids (Slurm's largest job id is
    67,043,328), starting where the clock is: a lab never reuses the ids of a lab before it
    (for 92 days) nor of a lab in another slot."""
    span = 8_000_000
    return 1 + slot * span + int(now) % (span - 100_000)  # room for the lab's own jobs


def slurm_problem() -> str | None:
    """Why Slurm cannot run here, in one line, or None."""
    missing = missing_packages({**DAEMONS, **CLIENTS})
    if missing:
        return (f"this section runs a real Slurm cluster and needs Debian's {', '.join(missing)}: "
                f"{install_hint(missing)}")
    if os.geteuid() != 0 and not lab_problem() and LabHost.get().groups_problem:
        return ("Slurm's daemons call setgroups, which a user namespace allows only when uidmap's newgidmap "
                f"mapped it, and here {LabHost.get().groups_problem}: it needs util-linux 2.38 or newer, "
                "uidmap (`sudo apt-get install uidmap`) and this user's ranges in /etc/subuid and "
                "/etc/subgid (adduser writes them)")
    return None


def require_slurm() -> None:
    """Raise ``LabUnavailable`` where the lab or its Slurm cannot run: a Slurm section's first output."""
    require_lab()
    problem = slurm_problem()
    if problem:
        raise LabUnavailable(problem)


class SlurmError(RuntimeError):
    """A Slurm command failed, or a job did not reach the state it had to."""


class SlurmLab:
    """A Slurm cluster whose compute nodes are the nodes of ``lab``."""

    def __init__(self, lab: ClusterLab, cpus_per_node: int | None = None, quiet: bool = False):
        self.lab = lab
        self.cpus_per_node = cpus_per_node or os.cpu_count() or 1
        self.quiet = quiet
        self._daemons: list[subprocess.Popen] = []
        self.started = False

    @property
    def dir(self) -> Path:
        return self.lab.dir / "slurm"

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict:
        """The environment of a shell on the login node: Slurm's config, and this Python's tools first."""
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": path}

    # ---------------------------------------------------------------- start and stop

    def up(self, timeout: float = 60) -> SlurmLab:
        problem = slurm_problem()
        if problem:
            raise LabUnavailable(problem)
        if self.lab.slot is None:
            raise LabError("bring the cluster lab up first")
        self.started = True
        atexit.register(self.down)
        try:
            self._write_files()
            self._start_daemons()
            self._wait_for_idle_nodes(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _write_files(self) -> None:
        for sub in ("munge", "state", *(f"spool-{n.hostname}" for n in self.lab.nodes)):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket directory others may write to, and clients must reach the socket.
        (self.dir / "munge").chmod(0o711)
        key = subprocess.run([*host_prefix(), "mungekey", "--create", f"--keyfile={self.dir / 'munge' / 'munge.key'}"],
                             capture_output=True, text=True, timeout=30)
        if key.returncode != 0:
            raise SlurmError(f"mungekey could not create a key: {key.stderr.strip()}")
        nodes = "\n".join(f"NodeName={n.hostname} NodeAddr={n.address} CPUs={self.cpus_per_node} State=UNKNOWN"
                          for n in self.lab.nodes)
        self.conf.write_text(SLURM_CONF.format(
            slot=self.lab.slot, host=socket.gethostname().split(".")[0], host_address=self.lab.host_address,
            ctld_port=6817 + 10 * (self.lab.slot + 1), dir=self.dir, nodes=nodes,
            first_job_id=first_job_id(self.lab.slot, time.time())))

    def _start_daemons(self) -> None:
        munge = self.dir / "munge"
        files = {"socket": "munge.sock", "key-file": "munge.key",
                 "pid-file": "munged.pid", "log-file": "munged.log",
                 "seed-file": "munged.seed"}
        self._spawn(["munged", "--foreground", "--force",
                     *(f"--{option}={munge / name}"
                       for option, name in files.items())])
        self._wait_for((munge / "munge.sock").exists, 10, "munged has no socket")
        # The controller runs on the host, the login node of the lab.
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)])
        # Each slurmd runs on its node, under the node's name: jobs start inside the
        # node.
        for node in self.lab.nodes:
            slurmd = ["slurmd", "-D", "-N", node.hostname, "-f", self.conf]
            self._daemons.append(self.lab.popen(node.index, slurmd,
                                                stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL))

    def _spawn(self, argv: list[str]) -> None:
        self._daemons.append(subprocess.Popen([*host_prefix(), *argv], stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL, env=self.env, start_new_session=True))

    def _wait_for_idle_nodes(self, timeout: float) -> None:
        def all_idle() -> bool:
            for proc in self._daemons:
                if proc.poll() is not None:
                    raise SlurmError(f"{shlex.join(map(str, proc.args))[-60:]} exited with {proc.returncode}; "
                                     f"its log is in {self.dir}\n{self.log_tail()}")
            done = subprocess.run([*host_prefix(), "sinfo", "-h", "-o", "%T %D"], capture_output=True, text=True,
                                  env=self.env)
            return done.returncode == 0 and done.stdout.split() == ["idle", str(len(self.lab.nodes))]

        self._wait_for(all_idle, timeout, "the Slurm nodes did not become idle")

    def _wait_for(self, condition, timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise SlurmError(f"{message} within {timeout:.0f} s\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for log in sorted(self.dir.glob("*.log")):
            out += [f"--- {log.name}", *log.read_text(errors="replace").splitlines()[-lines:]]
        return "\n".join(out)

    def down(self) -> None:
        """Cancel every job, stop slurmd (and every job process on the nodes), slurmctld and munged."""
        if not self.started:
            return
        self.started = False
        atexit.unregister(self.down)
        if self._daemons and self._daemons[0].poll() is None and self.conf.exists():
            subprocess.run([*host_prefix(), "scancel", "--full", "--user=root"], capture_output=True, env=self.env,
                           timeout=30)
        for node in self.lab.nodes:  # slurmd and slurmstepd, and whatever jobs still run there
            self.lab.kill_node(node.index)
        for proc in reversed(self._daemons):
            _stop(proc)
        self._daemons = []

    def leftovers(self) -> list[str]:
        """Slurm or munge processes that use this lab's configuration ([] after down())."""
        found = []
        for proc_dir in Path("/proc").glob("[0-9]*"):
            try:
                cmdline = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(self.dir) in cmdline:
                found.append(f"process {proc_dir.name}: {cmdline.strip()[:100]}")
        return found

    def __enter__(self) -> SlurmLab:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ---------------------------------------------------------------- using it

    def run(self, *argv, timeout: float = 60, check: bool = True, show: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm command on the login node (the host), printing it and its output."""
        argv = [str(a) for a in argv]
        if show and not self.quiet:
            print(f"$ {shlex.join(argv)}", flush=True)
        done = subprocess.run([*host_prefix(), *argv], capture_output=True, text=True, env=self.env, timeout=timeout,
                              cwd=REPO_ROOT)
        if show and not self.quiet:
            print((done.stdout + done.stderr).rstrip(), flush=True)
        if check and done.returncode != 0:
            raise SlurmError(f"{shlex.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def submit(self, script: str, script_args=(), options=(), env: dict | None = None) -> int:
        """``sbatch OPTIONS SCRIPT SCRIPT_ARGS`` from the repository root; returns the job id.

        ``env`` adds variables to the submitting shell's environment, which the job inherits
        (sbatch exports it by default).
        """
        argv = ["sbatch", "--parsable", *map(str, options), str(script), *map(str, script_args)]
        extra = env or {}
        if not self.quiet:
            exported = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in extra.items())
            print(f"$ {(exported + ' ') if exported else ''}{shlex.join(argv)}", flush=True)
        done = subprocess.run([*host_prefix(), *argv], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                              env={**self.env, **{k: str(v) for k, v in extra.items()}})
        if done.returncode != 0:
            raise SlurmError(f"sbatch refused the job: {done.stderr.strip()}")
        job = int(done.stdout.strip().split(";")[0])
        if not self.quiet:
            print(f"Submitted batch job {job}", flush=True)
        return job

    def job(self, job: int) -> dict:
        """``scontrol show job`` as a dict (JobState, Restarts, NodeList, StdOut, ...)."""
        done = self.run("scontrol", "show", "job", "--oneliner", job, show=False)
        return dict(field.split("=", 1) for field in done.stdout.split() if "=" in field)

    def wait(self, job: int, until=("COMPLETED",), timeout: float = 300, poll_s: float = 0.5) -> dict:
        """Wait until the job's state is one of ``until``; print each state it passes through.

        A finished state that is not in ``until`` raises, with the end of the job's output.
        """
        deadline, last = time.monotonic() + timeout, None
        while True:
            info = self.job(job)
            state = info["JobState"]
            if state != last and not self.quiet:
                print(f"  job {job}: {state}" + (f" ({info['Reason']})" if info.get("Reason") not in
                                                  (None, "None") else ""), flush=True)
                last = state
            if state in until:
                return info
            if state in FINISHED:
                raise SlurmError(f"job {job} ended {state}, not {' or '.join(until)}\n{self.output(job)[-3000:]}")
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job} still {state} after {timeout:.0f} s\n{self.output(job)[-3000:]}")
            time.sleep(poll_s)

    def output(self, job: int) -> str:
        """The job's output file (StdOut), as far as it has been written."""
        path = Path(self.job(job)["StdOut"])
        return path.read_text(errors="replace") if path.exists() else ""


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
