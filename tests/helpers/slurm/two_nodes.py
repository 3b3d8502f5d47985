"""A real two-node Slurm cluster on one machine: ``slurmd`` in each of two network namespaces.

Built on ``tests.helpers.netns.two_nodes``: node ``dma`` is namespace a (it also runs
``slurmctld``, listening on a's veth address), node ``dmb`` is namespace b. Everything is
private to one call — the config, state, spool and log folders in a scratch folder, and a
munged of its own on a socket there (``AuthInfo=socket=...``; the machine's munge key is
shared, as on a real cluster) — so it neither touches nor needs the single-node test cluster
(``local_cluster.sh``) or /etc/slurm. Daemons run in the foreground as children of the test and
are killed with the namespaces; the scratch folder is removed.

The configuration is the single-node cluster's template (``slurm.conf.in``, ``fill_conf``) filled
for two nodes. Jobs are submitted inside namespace a with ``SLURM_CONF`` set, and no
``MASTER_ADDR``: each task finds its master as on a real cluster (``launch/env.py``: the first
node of the step, ``dma``, which both namespaces resolve to a's veth address through their own
/etc/hosts, ``netns.two_nodes(names=...)``). ``GLOO_SOCKET_IFNAME`` is the veth's name, the same
in both namespaces.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tests.helpers import netns

REPO_ROOT = Path(__file__).resolve().parents[3]
NODES = ("dma", "dmb")
MUNGE_KEY = Path("/etc/munge/munge.key")


def skip_reason() -> str | None:
    """Why a two-node cluster cannot be made here (None when it can). Missing Slurm or munge is
    no reason where ``local_cluster.sh install`` can install them (root and apt-get): on a
    fresh machine this is decided at collection, before any test has installed anything."""
    from tests.helpers.slurm import missing_binaries, slurm_skip_reason

    reason = netns.unavailable()
    if reason:
        return reason
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    if missing_binaries() or not MUNGE_KEY.is_file():
        return slurm_skip_reason()
    return None


def ensure_installed() -> None:
    """Slurm, munge and the machine's munge key, installed or created where absent (``local_cluster.sh
    install``: apt-get, the key; no daemon is started)."""
    from tests.helpers.slurm import LOCAL_CLUSTER, missing_binaries

    if not missing_binaries() and MUNGE_KEY.is_file():
        return
    proc = subprocess.run(["bash", str(LOCAL_CLUSTER), "install"], capture_output=True, text=True,
                          timeout=1200, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    missing = missing_binaries() + ([] if MUNGE_KEY.is_file() else [str(MUNGE_KEY)])
    if proc.returncode != 0 or missing:
        raise RuntimeError(f"local_cluster.sh install failed (exit {proc.returncode}); missing "
                           f"{missing}\n{proc.stdout}\n{proc.stderr}")


def _with_host_cgroups(argv: list[str]) -> list[str]:
    """``argv`` behind a shell that first mounts the host's cgroup file systems again.

    ``ip netns exec`` gives its command a fresh /sys (for the namespace's own /sys/class/net),
    without /sys/fs/cgroup, and slurmd refuses to start without it. The mounts happen in the
    private mount namespace ``ip netns exec`` made for this command only.
    """
    mounts = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        src, where, kind, opts = line.split()[:4]
        if where == "/sys/fs/cgroup" or where.startswith("/sys/fs/cgroup/"):
            mounts.append(f"mkdir -p {where} && mount -t {kind} -o {opts} {src} {where}")
    return ["sh", "-c", " && ".join([*mounts, 'exec "$@"']), "sh", *argv]


def _conf(root: Path, nodes: netns.TwoNodes) -> str:
    from tests.helpers.slurm import fill_conf

    host = socket.gethostname().split(".")[0]  # slurmctld checks that it runs on SlurmctldHost
    return fill_conf(
        HEADER="# two-node test cluster (tests/helpers/slurm/two_nodes.py)",
        CLUSTER_NAME="deinfer2n",
        CONTROLLER=f"{host}({nodes.addr[0]})",
        AUTH_INFO=f"AuthInfo=socket={root}/munge/socket",
        STATE_DIR=f"{root}/state",
        SLURMD_SPOOL_DIR=f"{root}/spool/%n",
        SLURMCTLD_PID_FILE=f"{root}/run/slurmctld.pid",
        SLURMD_PID_FILE=f"{root}/run/slurmd-%n.pid",
        SLURMCTLD_LOG_FILE=f"{root}/log/slurmctld.log",
        SLURMD_LOG_FILE=f"{root}/log/slurmd-%n.log",
        SLURMD_PARAMETERS="",
        NODES="\n".join(f"NodeName={name} NodeAddr={addr} CPUs={os.cpu_count()} RealMemory=1024 State=UNKNOWN"
                         for name, addr in zip(NODES, nodes.addr)),
        NODE_NAMES=",".join(NODES),
    )


@dataclass
class Cluster:
    nodes: netns.TwoNodes
    root: Path

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        return dict(env, SLURM_CONF=str(self.root / "slurm.conf"), GLOO_SOCKET_IFNAME=self.nodes.dev[0],
                    DEINFER_REPO=str(REPO_ROOT), DEINFER_PYTHON=sys.executable, OMP_NUM_THREADS="1")

    def run(self, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return self.nodes.run(0, argv, env=self.env, capture_output=True, text=True, timeout=timeout)

    def logs(self) -> str:
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            parts.append(f"--- {log.name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(parts)

    def sbatch(self, script: str, *args: str, script_args: tuple[str, ...] = (), timeout: float = 300) -> tuple[int, str]:
        """``sbatch --wait`` from the repository root; (exit status, the job's output)."""
        out = self.root / f"job-{time.monotonic_ns()}.out"
        argv = ["sbatch", "--wait", f"--output={out}", *args, str(REPO_ROOT / script), *script_args]
        try:
            proc = self.nodes.run(0, argv, env=self.env, cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=timeout)
            rc, said = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            self.run(["scancel", "--full", "--user=root"])
            rc, said = 124, f"timed out after {timeout:.0f} s (job cancelled)"
        text = out.read_text(errors="replace") if out.exists() else ""
        if rc != 0:
            text += f"\n--- sbatch ---\n{said}\n{self.logs()}"
        return rc, text


def _wait_idle(cluster: Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    states = ""
    while time.monotonic() < deadline:
        states = cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout
        if sorted(states.split()) == sorted([NODES[0], "idle", NODES[1], "idle"]):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the two-node cluster did not become idle within {timeout:.0f} s "
                       f"(sinfo: {states.strip()!r})\n{cluster.logs()}")


@contextlib.contextmanager
def two_node_cluster(rate: str | None = None, start_timeout: float = 60) -> Iterator[Cluster]:
    """slurmctld + slurmd on node a, slurmd on node b; all stopped and removed on exit."""
    ensure_installed()
    root = Path(tempfile.mkdtemp(prefix="deinfer-slurm2n-"))
    try:
        with netns.two_nodes(rate, names=NODES) as nodes:
            os.chmod(root, 0o755)
            for sub in ("state", "run", "log", "munge", *(f"spool/{n}" for n in NODES)):
                (root / sub).mkdir(parents=True, exist_ok=True)
            shutil.chown(root / "munge", "munge", "munge")
            (root / "slurm.conf").write_text(_conf(root, nodes))
            cluster = Cluster(nodes, root)
            m = root / "munge"
            nodes.popen(0, ["setpriv", "--reuid=munge", "--regid=munge", "--clear-groups", "munged", "-F",
                            f"--socket={m}/socket", f"--pid-file={m}/pid", f"--log-file={m}/log",
                            f"--seed-file={m}/seed", f"--key-file={MUNGE_KEY}"])
            deadline = time.monotonic() + 10
            while not (m / "socket").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"munged did not start: {(m / 'log').read_text(errors='replace')[-2000:]}")
                time.sleep(0.05)
            conf = str(root / "slurm.conf")
            quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            nodes.popen(0, ["slurmctld", "-D", "-i", "-f", conf], **quiet)
            for node in (0, 1):
                nodes.popen(node, _with_host_cgroups(["slurmd", "-D", "-N", NODES[node], "-f", conf]), **quiet)
            _wait_idle(cluster, start_timeout)
            yield cluster
    finally:
        shutil.rmtree(root, ignore_errors=True)
