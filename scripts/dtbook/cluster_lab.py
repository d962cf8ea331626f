"""A cluster in a box: network namespaces as nodes, a bridge as their switch, tbf as the link speed.

    python -m dtbook.cluster_lab up --nodes 2 --rate-gbit 1   # build a lab; Ctrl-C tears it down
    python -m dtbook.cluster_lab status                       # the labs on this machine
    python -m dtbook.cluster_lab down                         # remove what a killed lab left behind

Each node is a Linux network namespace with one interface, ``eth0``, cabled (a veth pair) to a
bridge on the host, which keeps an address on the bridge as a login node would. A process started
"on" a node sees only that node's network, its own host name (``node0``, ``node1``, ...) and an
/etc/hosts naming every node, so programs that find their peers by host name work unchanged. A
``tbf`` queue on both ends of each cable limits the link to the rate asked for, in each direction.

Everything a lab creates carries its slot's prefix (``dtb<slot>``) and ``down()`` removes it: on a
normal exit, on an exception inside ``with ClusterLab(...)``, at interpreter exit, and on SIGTERM or
SIGHUP. A lab killed outright leaves its slot's lock free, and the next lab in that slot cleans up
first. The only addresses used are the lab's own (10.77.<slot>.0/24, on its bridge and namespaces).

It needs iproute2, and root or an unprivileged user namespace. As root the lab lives in the host's
own network. An ordinary user gets a *lab host* instead: one process started with ``unshare --user
--map-root-user --net --mount``, in whose namespaces the user is root, so it can create network
namespaces, veths, a bridge and tbf queues there; every command that builds or drives the lab enters
it first (``nsenter``). The lab host stands in for the machine's network: it has its own loopback and
the bridge. When the Python process that started it ends, even killed outright, the lab host kills
every process left in its user namespace (nodes, jobs, Slurm's daemons), and the lab is gone with it.
Each process has its own lab host, so ``status`` and ``down`` see only their own (and need no clean-up
of an ordinary user's labs). This module does not import torch.
"""

from __future__ import annotations

import argparse
import atexit
import fcntl
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Slot locks and each lab's files (hosts, Slurm's state). An ordinary user cannot write /run, and
# inside the lab host /run is a private tmpfs, so their labs keep them in a folder of their own.
STATE_DIR = Path("/run/dtbook-lab") if os.geteuid() == 0 else Path(f"/tmp/dtbook-lab-{os.geteuid()}")
# Distributions install ip, tc and Slurm's daemons in sbin, which an ordinary user's PATH leaves out.
SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")
PREFIX = "dtb"
SLOTS = 8  # labs that can exist side by side, each in its own /24
INTERFACE = "eth0"
TOOLS = {"ip": "iproute2", "tc": "iproute2", "nsenter": "util-linux", "unshare": "util-linux"}
# Run on a node: its host name, the lab's /etc/hosts and resolv.conf (private mounts), then the command.
NODE_INIT = 'hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$3" /etc/resolv.conf ' \
            '&& shift 3 && exec "$@"'
# The lab has no DNS server: names come from its /etc/hosts, and a lookup that misses fails at once
# against the node's own loopback instead of waiting for a server nobody can reach.
RESOLV_CONF = "# cluster lab: no DNS, names resolve from /etc/hosts\noptions timeout:1 attempts:1\n"

BANDWIDTH_RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
server.settimeout(30)
conn, _ = server.accept()
conn.settimeout(30)
first = conn.recv(1 << 20)
start, received = time.perf_counter(), 0
while chunk := conn.recv(1 << 20):
    received += len(chunk)
print(received, time.perf_counter() - start, len(first), flush=True)
"""
BANDWIDTH_SENDER = """
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
block = bytes(1 << 20)
for _ in range(int(sys.argv[3])):
    conn.sendall(block)
conn.close()
"""


class LabUnavailable(RuntimeError):
    """The lab cannot be built here; the message says what it needs and how to run it."""

    def _render_traceback_(self) -> list[str]:
        """In a notebook, IPython shows this one line instead of a traceback."""
        return [f"{type(self).__name__}: {self}"]


class LabError(RuntimeError):
    """A command that builds or drives the lab failed."""


def require_lab() -> None:
    """Raise ``LabUnavailable`` where no lab can be built: the first output of a section that needs one.

    An ordinary user's lab host starts here, so that a failure to start it is that first output too.
    """
    problem = lab_problem()
    if problem:
        raise LabUnavailable(problem)
    if os.geteuid() != 0:
        LabHost.get()


def add_sbin_to_path() -> None:
    """Put the system's sbin folders at the end of this process's PATH (its children inherit it)."""
    path = os.environ.get("PATH", os.defpath).split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join(path + [d for d in SBIN if d not in path])


def missing_packages(tools: dict[str, str]) -> list[str]:
    """The packages of ``tools`` ({tool: package}) that are not installed, sbin searched too."""
    add_sbin_to_path()
    return sorted({package for tool, package in tools.items() if shutil.which(tool) is None})


def install_hint(packages: list[str]) -> str:
    """The one command that installs ``packages`` on Debian or Ubuntu."""
    return f"`{'' if os.geteuid() == 0 else 'sudo '}apt-get install {' '.join(packages)}`"


def lab_problem() -> str | None:
    """Why a lab cannot be built on this machine, in one line, or None."""
    missing = missing_packages(TOOLS)
    if missing:
        return f"the cluster lab needs {' and '.join(missing)}: {install_hint(missing)}, or `make slurm`"
    if os.geteuid() != 0:
        return _user_namespace_problem()
    return None


_USERNS_PROBE: list[str | None] = []  # the answer, once asked: it does not change while we run


def _user_namespace_problem() -> str | None:
    if not _USERNS_PROBE:
        probe = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "--mount", "true"],
                               capture_output=True, text=True, timeout=30)
        why = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
        _USERNS_PROBE.append(None if probe.returncode == 0 else (
            "the cluster lab needs root or unprivileged user namespaces, and this kernel refuses "
            f"them to this user ({why}); as root: `sysctl kernel.unprivileged_userns_clone=1` "
            "(Debian), `sysctl kernel.apparmor_restrict_unprivileged_userns=0` (Ubuntu 24.04+)"))
    return _USERNS_PROBE[0]


# The lab host's set-up, run as root of its namespaces: /run/netns must be writable for `ip netns`.
# Where the machine has no /run/netns yet, the user cannot create it, so a tmpfs covers all of /run
# inside the lab host (with /etc/resolv.conf's target made again where that is a link into /run,
# so nodes can mount their own over it). Lab processes then miss what else /run held: the user's
# XDG_RUNTIME_DIR, /run/lock, syslog's socket; nothing the lab runs needs them. Loopback comes up;
# then it waits until its owner closes stdin or dies, and kills every process left in its user
# namespace (nodes, jobs, Slurm's daemons), which would otherwise keep the lab alive.
LAB_HOST_INIT = """
set -e
if [ -d /run/netns ]; then mount -t tmpfs lab-netns /run/netns
else
  resolv=$(readlink -m /etc/resolv.conf)
  mount -t tmpfs lab-run /run && mkdir /run/netns
  case "$resolv" in /run/*) mkdir -p "$(dirname "$resolv")" && : > "$resolv";; esac
fi
ip link set lo up
echo ready
cat >/dev/null || true
me=$(readlink /proc/$$/ns/user)
for round in 1 2 3 4 5; do
  for proc in /proc/[0-9]*; do
    pid=${proc#/proc/}
    [ "$pid" != $$ ] && [ "$(readlink "$proc/ns/user" 2>/dev/null)" = "$me" ] && kill -9 "$pid" 2>/dev/null \
      || true
  done
  sleep 0.1
done
"""


class LabHost:
    """The namespaces an ordinary user's labs live in (see the module's docstring); one per process."""

    _current: LabHost | None = None
    _lock = threading.Lock()

    def __init__(self):
        # Slurm's daemons call setgroups, which the kernel allows in a user namespace only when a
        # privileged helper, uidmap's newgidmap, wrote its group map (user_namespaces(7)). unshare's
        # --map-auto (util-linux 2.38+) has newuidmap/newgidmap map the user's ranges from
        # /etc/subuid and /etc/subgid; where that fails, the lab host maps the user alone: the
        # cluster lab works, Slurm does not, and groups_problem says why.
        self.groups_problem: str | None = "uidmap's newuidmap and newgidmap are not installed"
        attempts = [["--map-auto"], []] if shutil.which("newuidmap") and shutil.which("newgidmap") else [[]]
        for extra in attempts:
            self.proc = subprocess.Popen(["unshare", "--user", "--map-root-user", *extra, "--net", "--mount",
                                          "--propagation", "private", "sh", "-c", LAB_HOST_INIT],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
            if self.proc.stdout.readline().strip() == "ready":
                break
            self.proc.wait(timeout=10)
            error = " ".join(self.proc.stderr.read().split())[-300:] or f"exit {self.proc.returncode}"
            if extra:
                self.groups_problem = f"`unshare --map-auto` failed ({error})"
        else:
            raise LabUnavailable(f"the lab host did not start: {error}")
        if Path(f"/proc/{self.proc.pid}/setgroups").read_text().strip() == "allow":
            self.groups_problem = None
        self.owner = os.getpid()
        atexit.register(self.close)

    def alive(self) -> bool:
        if os.getpid() != self.owner:  # a forked child: the lab host is its parent's child, not its own
            return Path(f"/proc/{self.proc.pid}").exists()
        return self.proc.poll() is None

    @classmethod
    def get(cls) -> LabHost:
        with cls._lock:
            if cls._current is None or not cls._current.alive():
                cls._current = cls()
            return cls._current

    @classmethod
    def running(cls) -> bool:
        """Whether this process has a live lab host (one is never started just to tear a lab down)."""
        return cls._current is not None and cls._current.alive()

    def enter(self, *namespaces: str) -> list[str]:
        """The prefix that runs a command as root of the lab host (the user's own uid), in its user
        namespace and ``namespaces`` of its others ("--net", "--mount", "--net=FILE")."""
        # --preserve-credentials: nsenter would otherwise call setgroups, which a namespace mapped
        # by an unprivileged user may refuse; the user's uid already is root inside.
        return ["nsenter", f"--target={self.proc.pid}", "--user", *namespaces, "--preserve-credentials", "--"]

    def path(self, inside: str) -> str:
        """A path of the lab host's own mounts (``/run/netns/...``), as this process can open it."""
        return f"/proc/{self.proc.pid}/root{inside}"

    def close(self) -> None:
        if os.getpid() == self.owner and self.proc.poll() is None:
            self.proc.stdin.close()  # its `cat` ends: it kills what is left, and the namespaces go
            self.proc.wait(timeout=30)
        atexit.unregister(self.close)


def lab_prefix() -> list[str]:
    """What runs a command that builds or inspects labs (ip, tc): nothing as root; for an ordinary
    user, the lab host's network and its mounts, which hold /run/netns."""
    return [] if os.geteuid() == 0 else LabHost.get().enter("--net", "--mount")


def host_prefix() -> list[str]:
    """What runs a program on the labs' host (Slurm's controller and commands): nothing as root; for an
    ordinary user, the lab host's network only. Its mounts are left out: a process that entered them
    would work in a folder it cannot reach from there (a rename beside it fails, EXDEV)."""
    return [] if os.geteuid() == 0 else LabHost.get().enter("--net")


def lab_path(inside: str) -> str:
    """A path of the labs' mounts (``/run/netns/<namespace>``) as this process opens it."""
    return inside if os.geteuid() == 0 else LabHost.get().path(inside)


@dataclass(frozen=True)
class Node:
    index: int
    hostname: str  # node0, node1, ...: what the node's processes see as their host name
    address: str  # its address on the lab's switch
    netns: str  # the network namespace that is the node
    host_link: str  # the host's end of its cable, plugged into the bridge
    interface: str = INTERFACE  # the node's end, as the node sees it


def _command(argv: list[str], timeout: float = 30) -> str:
    done = subprocess.run([*lab_prefix(), *argv], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise LabError(f"{' '.join(argv)} failed: {detail[-1] if detail else done.returncode}")
    return done.stdout


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _command(["ip", "netns", "list"]).splitlines() if line.strip()]


def _links() -> list[str]:
    return [line.split(":")[1].strip().split("@")[0] for line in _command(["ip", "-o", "link"]).splitlines()]


def _pids_in(netns: str) -> list[int]:
    try:
        return [int(pid) for pid in _command(["ip", "netns", "pids", netns]).split()]
    except LabError:  # the namespace is already gone
        return []


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _end_processes_in(netns: str, grace_s: float = 3.0) -> None:
    """SIGTERM everything in the namespace, SIGKILL what is left after ``grace_s``."""
    _signal_all(_pids_in(netns), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _pids_in(netns) and time.monotonic() < deadline:
        time.sleep(0.1)
    for _ in range(20):  # a dying parent may still fork; repeat until the namespace is empty
        pids = _pids_in(netns)
        if not pids:
            return
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.1)


def remove_slot(slot: int) -> list[str]:
    """Delete every namespace and link of ``slot`` and the processes inside; return what was removed."""
    removed = []
    namespaces = [netns for netns in _namespaces() if netns.startswith(f"{PREFIX}{slot}-")]
    for netns in namespaces:
        _end_processes_in(netns)
    # Cables before namespaces: deleting a veth takes its peer with it at once, while a deleted
    # namespace releases its veths later, in the kernel's own time, so a cable listed a moment ago
    # may be gone by the time we delete it (a CI run failed on exactly that).
    for link in _links():
        if link.startswith(f"{PREFIX}{slot}") and _delete_link(link):
            removed.append(f"link {link}")
    for netns in namespaces:
        _command(["ip", "netns", "del", netns])
        removed.append(f"namespace {netns}")
    _wait_until_links_gone(f"{PREFIX}{slot}")
    shutil.rmtree(STATE_DIR / str(slot), ignore_errors=True)
    return removed


def _delete_link(link: str) -> bool:
    """Delete ``link``; False if it was already gone (a veth goes with its peer)."""
    try:
        _command(["ip", "link", "del", link])
    except LabError as err:
        if "Cannot find device" in str(err):
            return False
        raise
    return True


def _wait_until_links_gone(prefix: str, timeout: float = 10) -> None:
    """Return once no link named ``prefix...`` is left, so the next lab in the slot can reuse the names."""
    deadline = time.monotonic() + timeout
    while left := [link for link in _links() if link.startswith(prefix)]:
        if time.monotonic() > deadline:
            raise LabError(f"links {', '.join(left)} still exist {timeout:g} s after their lab was removed")
        time.sleep(0.05)


def _try_lock(slot: int) -> int | None:
    """An open, exclusively locked file descriptor for ``slot``, or None if another lab holds it."""
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)  # munged refuses a folder others may write
    state = os.lstat(STATE_DIR)
    if not stat.S_ISDIR(state.st_mode) or state.st_uid != os.geteuid() or state.st_mode & 0o077:
        # In /tmp another user could have made it first: the munge key and hosts file go in there.
        raise LabUnavailable(f"{STATE_DIR} must be a folder of this user's that no one else may open; "
                             "remove it and try again")
    fd = os.open(STATE_DIR / f"slot{slot}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


class ClusterLab:
    """``nodes`` machines on one switch, each link limited to ``rate_gbit`` (None: unshaped).

    Use it as a context manager, or call ``up()`` and ``down()``; ``down()`` also runs at exit.
    """

    def __init__(self, nodes: int = 2, rate_gbit: float | None = 1.0):
        if not 1 <= nodes <= 100:
            raise ValueError(f"a lab has 1 to 100 nodes, not {nodes}")
        self.node_count = nodes
        self.rate_gbit = rate_gbit
        self.slot: int | None = None  # while the lab is up
        self.last_slot: int | None = None  # the slot it had, also after down()
        self.nodes: list[Node] = []
        self._lock_fd: int | None = None
        self._netns_inodes: set[int] = set()
        self._procs: list[subprocess.Popen] = []
        self._previous_handlers: dict = {}
        self._down_lock = threading.Lock()

    # ---------------------------------------------------------------- building and removing

    @property
    def dir(self) -> Path:
        """This lab's own folder (its hosts file; Slurm keeps its state under it)."""
        return STATE_DIR / str(self.slot)

    @property
    def subnet(self) -> str:
        return f"10.77.{self.slot}"

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.slot}br"

    @property
    def host_address(self) -> str:
        """The host's address on the lab's switch: where nodes reach a service run on the host."""
        return f"{self.subnet}.1"

    def up(self) -> ClusterLab:
        require_lab()  # and an ordinary user's lab host, whose exit handler must run after down()'s
        if self.slot is not None:
            return self
        for slot in range(SLOTS):
            fd = _try_lock(slot)
            if fd is not None:
                self.slot = self.last_slot = slot
                self._lock_fd = fd
                break
        else:
            raise LabError(f"all {SLOTS} lab slots are in use (see `python -m dtbook.cluster_lab status`)")
        atexit.register(self.down)
        self._handle_termination_signals()
        try:
            remove_slot(self.slot)  # whatever a lab killed outright left in this slot
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        self.dir.mkdir(parents=True)
        self.nodes = [Node(k, f"node{k}", f"{self.subnet}.{10 + k}",
                           f"{PREFIX}{self.slot}-node{k}",
                           f"{PREFIX}{self.slot}v{k}")
                      for k in range(self.node_count)]
        _command(["ip", "link", "add", self.bridge, "type", "bridge"])
        _command(["ip", "addr", "add", f"{self.host_address}/24", "dev",
                  self.bridge])
        _command(["ip", "link", "set", self.bridge, "up"])
        for node in self.nodes:
            _command(["ip", "netns", "add", node.netns])
            self._netns_inodes.add(self.netns_inode(node.index))
            _command(["ip", "link", "add", node.host_link, "type", "veth",
                      "peer", "name", node.interface, "netns", node.netns])
            _command(["ip", "link", "set", node.host_link, "master", self.bridge,
                      "up"])
            _command(["ip", "-n", node.netns, "addr", "add", f"{node.address}/24",
                      "dev", node.interface])
            _command(["ip", "-n", node.netns, "link", "set", node.interface, "up"])
            _command(["ip", "-n", node.netns, "link", "set", "lo", "up"])
        hosts = ["127.0.0.1 localhost",
                 f"{self.host_address} {socket.gethostname()}"]
        hosts += [f"{node.address} {node.hostname}" for node in self.nodes]
        # Servers listening on IPv6 sockets see peers as ::ffff:a.b.c.d and look that
        # up.
        hosts += [f"::ffff:{node.address} {node.hostname}" for node in self.nodes]
        self.hosts_file.write_text("\n".join(hosts) + "\n")
        self.resolv_file.write_text(RESOLV_CONF)
        self.set_rate(self.rate_gbit)

    def netns_inode(self, node: int) -> int:
        """The inode of the node's network namespace: what ``/proc/<pid>/ns/net`` of its processes names."""
        return os.stat(lab_path(f"/run/netns/{self.nodes[node].netns}")).st_ino

    @property
    def hosts_file(self) -> Path:
        return self.dir / "hosts"

    @property
    def resolv_file(self) -> Path:
        return self.dir / "resolv.conf"

    def down(self) -> None:
        """Stop every process on the nodes, delete namespaces, cables and bridge. Safe to call twice."""
        with self._down_lock:
            if self.slot is None:
                return
            for proc in self._procs:
                _end_group(proc)
            if os.geteuid() == 0 or LabHost.running():  # a lab host that ended took the lab with it
                remove_slot(self.slot)
            self.slot = None
            os.close(self._lock_fd)
            self._lock_fd = None
            atexit.unregister(self.down)
            self._restore_signal_handlers()

    def __enter__(self) -> ClusterLab:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def _handle_termination_signals(self) -> None:
        """SIGTERM and SIGHUP exit through Python (so ``with`` blocks and atexit run), if nobody else handles them."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._previous_handlers[sig] = signal.signal(sig, _exit_on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._previous_handlers.items():
                if signal.getsignal(sig) is _exit_on_signal:
                    signal.signal(sig, handler)
        self._previous_handlers = {}

    def leftovers(self) -> list[str]:
        """What of this lab still exists: namespaces, links, processes in its namespaces. [] after down()."""
        slot = self.last_slot
        found = [f"namespace {n}" for n in _namespaces() if n.startswith(f"{PREFIX}{slot}-")]
        found += [f"link {link}" for link in _links() if link.startswith(f"{PREFIX}{slot}")]
        for proc_dir in Path("/proc").glob("[0-9]*"):
            try:
                inode = os.stat(proc_dir / "ns" / "net").st_ino
            except OSError:
                continue
            if inode in self._netns_inodes:
                found.append(f"process {proc_dir.name} in a lab namespace")
        found += [f"process {p.pid} started by the lab" for p in self._procs if p.poll() is None]
        return found

    # ---------------------------------------------------------------- the links

    def set_rate(self, rate_gbit: float | None) -> None:
        """Limit every node's link to ``rate_gbit`` in each direction, or remove the limit (None)."""
        if rate_gbit is not None and not rate_gbit > 0:
            raise ValueError(f"rate_gbit must be > 0 or None, got {rate_gbit}")
        for node in self.nodes:
            for netns, device in ((None, node.host_link), (node.netns, node.interface)):
                tc = ["tc"] if netns is None else ["tc", "-n", netns]
                if rate_gbit is None:
                    subprocess.run([*lab_prefix(), *tc, "qdisc", "del", "dev", device, "root"],
                                   capture_output=True)
                else:
                    _command([*tc, "qdisc", "replace", "dev", device, "root", *tbf_parameters(rate_gbit)])
        self.rate_gbit = rate_gbit

    def qdisc(self, node: int) -> str:
        """What ``tc qdisc show`` says about the node's interface, as seen from the node."""
        return _command(["tc", "-n", self.nodes[node].netns, "qdisc", "show", "dev", INTERFACE]).strip()

    def measure_bandwidth(self, sender: int = 0, receiver: int = 1, mib: int = 32, timeout: float = 60) -> float:
        """Bytes per second (in GB/s) of one TCP stream from node ``sender`` to node ``receiver``."""
        target = self.nodes[receiver]
        listener = self.popen(receiver, [sys.executable, "-c", BANDWIDTH_RECEIVER, target.address],
                              stdout=subprocess.PIPE, text=True)
        try:
            port = listener.stdout.readline().strip()
            if not port:
                raise LabError(f"the bandwidth receiver on {target.hostname} did not start")
            self.run(sender, [sys.executable, "-c", BANDWIDTH_SENDER, target.address, port, str(mib)],
                     timeout=timeout)
            out, _ = listener.communicate(timeout=timeout)
        finally:
            _end_group(listener)
        received, seconds, _first = out.split()
        return int(received) / float(seconds) / 1e9

    # ---------------------------------------------------------------- running things on nodes

    def node_command(self, node: int, argv) -> list[str]:
        """``argv`` as a command that runs on lab node ``node`` (its network, host name and hosts file)."""
        n = self.nodes[node]
        # An ordinary user's node is entered from outside the lab host's mounts (host_prefix says why).
        enter = (["nsenter", f"--net=/run/netns/{n.netns}", "--"] if os.geteuid() == 0 else
                 LabHost.get().enter(f"--net={lab_path(f'/run/netns/{n.netns}')}"))
        return [*enter, "unshare", "--uts", "--mount", "--",
                "sh", "-c", NODE_INIT, "node-init", n.hostname, str(self.hosts_file), str(self.resolv_file),
                *map(str, argv)]

    def run(self, node: int, argv, timeout: float = 60, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``node`` and wait; output captured as text unless ``kwargs`` say otherwise."""
        kwargs.setdefault("capture_output", True)
        done = subprocess.run(self.node_command(node, argv), text=True, timeout=timeout, **kwargs)
        if check and done.returncode != 0:
            raise LabError(f"on {self.nodes[node].hostname}: {' '.join(map(str, argv))} exited "
                           f"{done.returncode}: {(done.stderr or '').strip()[-500:]}")
        return done

    def popen(self, node: int, argv, **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``node`` in its own process group; ``down()`` stops it if it still runs."""
        proc = subprocess.Popen(self.node_command(node, argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def processes(self, node: int) -> list[int]:
        """Process ids of everything running on ``node``."""
        return _pids_in(self.nodes[node].netns)

    def kill_node(self, node: int) -> float:
        """Pull the plug: SIGKILL every process on ``node`` at once. Returns the time (time.time())."""
        at = time.time()
        for _ in range(20):
            pids = self.processes(node)
            if not pids:
                break
            _signal_all(pids, signal.SIGKILL)
            time.sleep(0.05)
        return at

    def kill_node_when(self, node: int, condition: Callable[[], bool], timeout: float = 300) -> PlugPull:
        """In the background: once ``condition()`` holds (polled every 0.1 s), ``kill_node(node)``."""
        return PlugPull(self, node, condition, timeout)

    # ---------------------------------------------------------------- describing it

    def describe(self) -> str:
        rate = "unshaped" if self.rate_gbit is None else f"tbf {self.rate_gbit:g} Gbit/s each way"
        lines = [f"{'node':<7} {'address':<12} {'interface':<10} {'namespace':<14} link",
                 *(f"{n.hostname:<7} {n.address:<12} {n.interface:<10} {n.netns:<14} {rate}" for n in self.nodes),
                 f"{'host':<7} {self.host_address:<12} {self.bridge:<10} {'(none)':<14} the switch"]
        return "\n".join(lines)

    def link_floor_seconds(self, sent_bytes: int) -> float:
        """The least time in which one node can send ``sent_bytes`` through its shaped link.

        tbf lets at most its bucket, then the rate: in t seconds no more than burst + rate * t
        bytes leave. Load on the machine only adds to a measured time, so a time below this floor
        means the bytes did not cross the link (or fewer were sent than counted).
        """
        if self.rate_gbit is None:
            raise ValueError("an unshaped lab's link has no floor")
        return max(sent_bytes - tbf_burst_bytes(self.rate_gbit), 0) / (self.rate_gbit * 1e9 / 8)


class PlugPull:
    """A background thread that kills a node once a condition holds; ``at`` is when it did."""

    def __init__(self, lab: ClusterLab, node: int, condition: Callable[[], bool], timeout: float):
        self.at: float | None = None
        self._thread = threading.Thread(target=self._watch, args=(lab, node, condition, timeout), daemon=True)
        self._thread.start()

    def _watch(self, lab, node, condition, timeout) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                self.at = lab.kill_node(node)
                return
            time.sleep(0.1)

    def wait(self, timeout: float | None = None) -> float | None:
        self._thread.join(timeout)
        return self.at


def tbf_parameters(rate_gbit: float) -> list[str]:
    """tbf for ``rate_gbit``: a bucket of one millisecond at the rate, a 50 ms
    queue."""
    rate_bits, burst = int(rate_gbit * 1e9), tbf_burst_bytes(rate_gbit)
    return ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "50ms"]


def tbf_burst_bytes(rate_gbit: float) -> int:
    """The bucket: a millisecond at the rate, and at least one 64 KiB segment (GSO)."""
    return max(int(rate_gbit * 1e9) // 8 // 1000, 64 * 1024)


def _end_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _exit_on_signal(signum, frame) -> None:
    sys.exit(128 + signum)


# -------------------------------------------------------------------- command line


def _status() -> None:
    for slot in range(SLOTS):
        namespaces = [n for n in _namespaces() if n.startswith(f"{PREFIX}{slot}-")]
        lock = STATE_DIR / f"slot{slot}.lock"
        fd = _try_lock(slot) if lock.exists() else None
        if fd is not None:
            os.close(fd)
        held = lock.exists() and fd is None
        if held or namespaces:
            owner = f"held by pid {lock.read_text().strip()}" if held else "stale (its owner is gone)"
            print(f"slot {slot}: {owner}; namespaces: {' '.join(namespaces) or 'none'}")


def _down() -> None:
    for slot in range(SLOTS):
        fd = _try_lock(slot)
        if fd is None:
            print(f"slot {slot}: in use by a running lab, left alone")
            continue
        try:
            for what in remove_slot(slot):
                print(f"slot {slot}: removed {what}")
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a lab and keep it until Ctrl-C")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--rate-gbit", type=float, default=1.0, help="link rate; 0 for unshaped")
    sub.add_parser("status", help="list the labs on this machine")
    sub.add_parser("down", help="remove what labs whose owner is gone left behind")
    args = parser.parse_args(argv)
    problem = lab_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    if args.command == "status":
        _status()
    elif args.command == "down":
        _down()
    else:
        with ClusterLab(args.nodes, args.rate_gbit or None) as lab:
            print(lab.describe())
            print(f"run a command on a node: {shlex.join(lab.node_command(0, ['bash']))}")
            print("Ctrl-C tears the lab down")
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass


if __name__ == "__main__":
    main()
