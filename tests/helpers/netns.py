"""Two "nodes" on one machine: Linux network namespaces joined by a veth pair, rate-limited.

``two_nodes()`` creates namespaces ``dm<pid>-<id>a`` and ``...b`` (unique per call), a veth pair
between them with the private addresses ``10.<x>.<y>.1`` / ``.2`` on a /30 chosen to collide with
nothing the host already routes, brings up each namespace's loopback and, with ``rate``, a
``tc qdisc ... tbf`` limit on both ends (netem is not available on these kernels, so there is no
added delay; tbf shapes bandwidth only). Processes run inside a namespace see only its own
loopback and veth end, so a job's traffic can go nowhere but to the other namespace.

With ``names``, the two nodes also resolve each other by name, as a cluster's DNS would make them:
``/etc/netns/<namespace>/hosts`` (the host's /etc/hosts plus the two names) is what ``ip netns
exec`` mounts over /etc/hosts for everything it starts, so the host's own file is untouched.

Clean-up is unconditional: the context manager deletes both namespaces (which removes the veth
pair) and their /etc/netns folders (/etc/netns too, when it made it) on any exit, an ``atexit``
hook deletes whatever an interrupted run left, and the next call removes the namespaces and
folders of a run killed outright (``remove_stale``: names carry the pid).
Processes started with ``TwoNodes.popen`` are stopped first (SIGTERM, then SIGKILL after 10 s).
Root and the ``ip``/``tc`` tools are needed: ``unavailable()`` says why not, for ``pytest.skip``.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

RATES = {"unlimited": None, "10gbit": "10gbit", "1gbit": "1gbit"}
_LIVE: set[str] = set()  # namespaces this process created and has not deleted yet
ETC_NETNS = Path("/etc/netns")  # per-namespace files that ``ip netns exec`` mounts over /etc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why two namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} tool (iproute2) is not installed"
    probe = f"dmprobe{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 in 10.0.0.0/8 that no address or route of the host overlaps."""
    used = []
    for cmd in (("-4", "-o", "addr"), ("-4", "route")):
        for line in _ip(*cmd).stdout.splitlines():
            for word in line.split():
                try:
                    used.append(ipaddress.ip_network(word, strict=False))
                except ValueError:
                    continue
    for _ in range(100):
        b = uuid.uuid4().bytes
        net = ipaddress.ip_network(f"10.{b[0]}.{b[1]}.{b[2] & 0xFC}/30")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("no free 10.x.y.z/30 subnet for the veth pair")


def _delete(name: str) -> None:
    _ip("netns", "del", name, check=False)
    shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    _LIVE.discard(name)


_NAME = re.compile(r"^dm(\d+)-[0-9a-f]{3}[ab]$")


def remove_stale() -> list[str]:
    """Delete namespaces this helper made in a process that is gone (killed before its clean-up
    ran), after killing what still runs inside them; other namespaces are never touched."""
    removed = []
    listed = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.split()]
    files = [p.name for p in ETC_NETNS.iterdir()] if ETC_NETNS.is_dir() else []
    for name in dict.fromkeys(listed + files):
        m = _NAME.match(name)
        if not m or Path(f"/proc/{m.group(1)}").exists():
            continue
        for pid in _ip("netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _delete(name)
        removed.append(name)
    return removed


@atexit.register
def _cleanup_all() -> None:
    for name in list(_LIVE):
        _delete(name)


@dataclass
class TwoNodes:
    """The two namespaces, their veth ends and addresses (node a is the master)."""

    ns: tuple[str, str]
    dev: tuple[str, str]  # the same name in both namespaces
    addr: tuple[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, node: int, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` to completion inside namespace ``node`` (0 or 1)."""
        return subprocess.run(["ip", "netns", "exec", self.ns[node], *argv], **kw)

    def popen(self, node: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside namespace ``node``; it is killed when the namespaces go."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns[node], *argv], **kw)
        self.procs.append(proc)
        return proc

    def launcher_env(self, node: int, port: int, **extra: str) -> dict[str, str]:
        """What a launcher sets for the rank on ``node`` of a TP=2 job with one rank per node:
        rank ``node``, node a's address as the master, gloo on the veth, one thread."""
        return dict(os.environ, RANK=str(node), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=self.addr[0],
                    MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=self.dev[node], OMP_NUM_THREADS="1", **extra)

    def set_rate(self, rate: str | None) -> None:
        """Limit both directions to ``rate`` (tc syntax, e.g. "1gbit"); None removes the limit."""
        for node in (0, 1):
            tc = ["tc", "qdisc", "replace" if rate else "del", "dev", self.dev[node], "root"]
            if rate:
                tc += ["tbf", "rate", rate, "burst", "1mb" if rate == "10gbit" else "256kb", "latency", "50ms"]
            self.run(node, tc, capture_output=True, text=True, check=rate is not None, timeout=30)

    def rate(self, node: int = 0) -> str:
        """The root qdisc of a veth end as tc shows it (what the limit really is)."""
        return self.run(node, ["tc", "qdisc", "show", "dev", self.dev[node]], capture_output=True,
                        text=True, check=True, timeout=30).stdout.strip()


@contextlib.contextmanager
def two_nodes(rate: str | None = None, names: tuple[str, str] | None = None) -> Iterator[TwoNodes]:
    """Two namespaces joined by a veth pair (optionally rate-limited, and with ``names`` the
    host names each resolves both nodes by), removed on any exit."""
    remove_stale()
    tag = f"dm{os.getpid()}-{uuid.uuid4().hex[:3]}"  # ≤ 14 characters with "v": device names allow 15
    ns = (f"{tag}a", f"{tag}b")
    dev = (f"{tag}v", f"{tag}v")  # one name on both ends: GLOO_SOCKET_IFNAME is the same everywhere
    net = _free_subnet()
    hosts = [str(h) for h in net.hosts()]
    nodes = TwoNodes(ns, dev, (hosts[0], hosts[1]))
    made_etc_netns = False
    try:
        for name in ns:
            _ip("netns", "add", name)
            _LIVE.add(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("link", "add", dev[0], "netns", ns[0], "type", "veth", "peer", "name", dev[1], "netns", ns[1])
        for node in (0, 1):
            _ip("-n", ns[node], "addr", "add", f"{hosts[node]}/30", "dev", dev[node])
            _ip("-n", ns[node], "link", "set", dev[node], "up")
        if rate:
            nodes.set_rate(rate)
        if names:
            made_etc_netns = not ETC_NETNS.exists()
            known = Path("/etc/hosts").read_text() if Path("/etc/hosts").is_file() else ""
            known += "\n" if known and not known.endswith("\n") else ""
            known += "".join(f"{addr}\t{name}\n" for addr, name in zip(nodes.addr, names))
            for name in ns:
                (ETC_NETNS / name).mkdir(parents=True, exist_ok=True)
                (ETC_NETNS / name / "hosts").write_text(known)
        yield nodes
    finally:
        for proc in reversed(nodes.procs):  # daemons get a moment to stop their own children
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(nodes.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for name in ns:
            _delete(name)
        if made_etc_netns:
            with contextlib.suppress(OSError):  # another run may be using it now
                ETC_NETNS.rmdir()
