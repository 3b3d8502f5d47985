"""Helpers for tests that run real Slurm jobs on a local single-node cluster.

The cluster is brought up by ``local_cluster.sh start`` beside this file (installs
``slurm-wlm`` + ``munge`` with apt-get on first use, needs root). That script changes the
host — it writes /etc/slurm/slurm.conf and the munge key, may add the hostname to /etc/hosts
and a policy-rc.d during the install — so it is test infrastructure and lives here, not in
``scripts/`` with what users run on their own clusters. Typical use::

    from tests.helpers.slurm import ensure_cluster, run_sbatch, slurm_skip_reason

    reason = slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    ensure_cluster()
    rc, out = run_sbatch("scripts/slurm/smoke.sbatch", "--ntasks=2", timeout=180)

Jobs are submitted from the repo root (so ``$SLURM_SUBMIT_DIR`` is the repo)
with ``DEINFER_REPO`` and ``DEINFER_PYTHON`` (this interpreter) exported, and without
``MASTER_ADDR`` / ``MASTER_PORT``, which the tasks derive from Slurm's variables.

Both test clusters (this one and ``two_nodes.py``'s) run one slurm.conf, ``slurm.conf.in``
beside this file, filled by ``local_cluster.sh`` and ``fill_conf``.

If ``ensure_cluster`` had to start the daemons, they are stopped again when
the Python process exits, unless ``DEINFER_SLURM_KEEP=1`` or running under
pytest-xdist (other workers may still be using the cluster).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
LOCAL_CLUSTER = Path(__file__).resolve().with_name("local_cluster.sh")
CONF_TEMPLATE = Path(__file__).resolve().with_name("slurm.conf.in")
SLURM_DIR = Path(os.environ.get("DEINFER_SLURM_DIR", "/var/spool/slurm-deinfer"))

_REQUIRED_BINARIES = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo",
                      "slurmctld", "slurmd", "munged")
# Cold start includes apt-get install; allow for a slow mirror.
START_TIMEOUT_S = float(os.environ.get("DEINFER_SLURM_START_TIMEOUT_S", "1200"))


class SlurmClusterError(RuntimeError):
    """The local Slurm cluster could not be brought up."""


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def missing_binaries() -> list[str]:
    """The Slurm and munge programs the test clusters run that are not installed."""
    return [b for b in _REQUIRED_BINARIES
            if shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]


def slurm_skip_reason() -> str | None:
    """Why Slurm tests cannot run here, or None if they can."""
    if not sys.platform.startswith("linux"):
        return f"local Slurm cluster needs Linux (platform {sys.platform})"
    if not _is_root():
        return "local Slurm cluster needs root (to run munged/slurmctld/slurmd and apt-get)"
    if missing_binaries() and shutil.which("apt-get") is None:
        return "slurm-wlm/munge not installed and apt-get unavailable to install them"
    if shutil.which("bash") is None:
        return "bash not available"
    return None


def slurm_available() -> bool:
    """True if we are root and either Slurm is installed or apt-get can install it."""
    return slurm_skip_reason() is None


_PLACEHOLDER = re.compile(r"@([A-Z_]+)@")


def fill_conf(**values: str) -> str:
    """The test clusters' slurm.conf (``slurm.conf.in``) with every ``@NAME@`` replaced by
    ``values[NAME]`` (which may span lines); a line holding only a placeholder whose value is
    empty is left out. ``local_cluster.sh`` (``fill_template``) fills the same template by the
    same rules for the single-node cluster, so both clusters run one configuration."""
    template = CONF_TEMPLATE.read_text()
    names = set(_PLACEHOLDER.findall(template))
    if names != set(values):
        raise ValueError(f"{CONF_TEMPLATE.name} needs values for exactly {sorted(names)}; "
                         f"missing {sorted(names - set(values))}, unknown {sorted(set(values) - names)}")
    lines = []
    for line in template.splitlines(keepends=True):
        alone = _PLACEHOLDER.fullmatch(line.rstrip("\n"))
        if alone and values[alone.group(1)] == "":
            continue
        lines.append(_PLACEHOLDER.sub(lambda m: values[m.group(1)], line))
    return "".join(lines)


_lock = threading.Lock()
_state: dict[str, object] = {"ready": False, "error": None, "start_seconds": None}


def _cluster_running() -> bool:
    try:
        out = subprocess.run(["bash", str(LOCAL_CLUSTER), "status"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return all(f"{d}: running" in out for d in ("munged", "slurmctld", "slurmd"))


def stop_cluster() -> None:
    """Stop the daemons (``local_cluster.sh stop``)."""
    subprocess.run(["bash", str(LOCAL_CLUSTER), "stop"], capture_output=True, text=True,
                   timeout=120)
    with _lock:
        _state["ready"] = False


def ensure_cluster() -> None:
    """Start the local cluster once per process; raise SlurmClusterError on failure.

    A failure is remembered: later calls re-raise it instead of retrying.
    """
    with _lock:
        if _state["ready"]:
            return
        if _state["error"] is not None:
            raise SlurmClusterError(str(_state["error"]))
        was_running = _cluster_running()
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                ["bash", str(LOCAL_CLUSTER), "start"],
                capture_output=True, text=True, timeout=START_TIMEOUT_S,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
        except subprocess.TimeoutExpired as exc:
            msg = (f"local_cluster.sh start timed out after {START_TIMEOUT_S:.0f}s\n"
                   f"--- stdout ---\n{exc.stdout or ''}\n--- stderr ---\n{exc.stderr or ''}")
            _state["error"] = msg
            raise SlurmClusterError(msg) from None
        if proc.returncode != 0:
            msg = (f"local_cluster.sh start failed (exit {proc.returncode})\n"
                   f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
            _state["error"] = msg
            raise SlurmClusterError(msg)
        _state["start_seconds"] = time.monotonic() - t0
        _state["ready"] = True
        sys.stderr.write(proc.stderr)
        keep = os.environ.get("DEINFER_SLURM_KEEP") == "1" or "PYTEST_XDIST_WORKER" in os.environ
        if not was_running and not keep:
            atexit.register(stop_cluster)


def cluster_start_seconds() -> float | None:
    """Wall time ensure_cluster() spent in ``local_cluster.sh start`` (None if not run)."""
    return _state["start_seconds"]  # type: ignore[return-value]


def _run_quiet(cmd: list[str], timeout: float = 20) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (p.stdout + p.stderr).rstrip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"<{' '.join(cmd)} failed: {exc}>"


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"


def slurm_diagnostics(job_id: str | None) -> str:
    """squeue / scontrol / sinfo / daemon log tails, for failure messages."""
    parts = [
        "$ squeue -a\n" + _run_quiet(["squeue", "-a", "-o", "%.10i %.12j %.8T %.12r %.10M %N"]),
        "$ sinfo -N -l\n" + _run_quiet(["sinfo", "-N", "-l"]),
    ]
    if job_id:
        parts.insert(0, f"$ scontrol show job {job_id}\n"
                        + _run_quiet(["scontrol", "show", "job", job_id]))
    parts.append(f"--- tail {SLURM_DIR}/log/slurmctld.log ---\n"
                 + _tail(SLURM_DIR / "log" / "slurmctld.log"))
    parts.append(f"--- tail {SLURM_DIR}/log/slurmd.log ---\n"
                 + _tail(SLURM_DIR / "log" / "slurmd.log"))
    return "\n\n".join(parts)


_SUBMITTED_RE = re.compile(r"Submitted batch job (\d+)")


def _find_job_by_output(out_path: str) -> str | None:
    txt = _run_quiet(["squeue", "-h", "-a", "-O", "JobID:20,STDOUT:1000"])
    for line in txt.splitlines():
        fields = line.split(None, 1)
        if len(fields) == 2 and fields[1].strip() == out_path:
            return fields[0]
    return None


def run_sbatch(script: str | os.PathLike[str], *args: str, timeout: float = 300,
               env: dict[str, str] | None = None,
               cwd: str | os.PathLike[str] | None = None,
               script_args: tuple[str, ...] = ()) -> tuple[int, str]:
    """Submit ``script`` with ``sbatch --wait --output=<tmpfile> *args script *script_args``.

    Returns ``(returncode, output_text)``: sbatch's exit status (the job's exit
    code with --wait; non-zero on timeout) and the job's combined stdout/stderr.
    On timeout the job is scancel'ed. On any failure Slurm diagnostics are
    printed (pytest shows them with the failing test) and, for timeouts,
    appended to the returned text.
    """
    script = Path(script)
    if not script.is_absolute():
        script = REPO_ROOT / script
    fd, out_path = tempfile.mkstemp(prefix="deinfer-sbatch-", suffix=".out")
    os.close(fd)
    os.chmod(out_path, 0o666)
    # No MASTER_ADDR / MASTER_PORT from this process: the tasks derive them (launch/env.py).
    job_env = {**{k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")},
               "DEINFER_REPO": str(REPO_ROOT), "DEINFER_PYTHON": sys.executable, **(env or {})}
    # stdbuf -oL: sbatch prints "Submitted batch job N" before waiting; line
    # buffering lets us read the id even if we later have to kill sbatch.
    cmd = ["sbatch", "--wait", f"--output={out_path}", *args, str(script), *script_args]
    if shutil.which("stdbuf"):
        cmd = ["stdbuf", "-oL", "-eL", *cmd]
    job_id: str | None = None
    sbatch_out: list[str] = []

    proc = subprocess.Popen(cmd, cwd=str(cwd or REPO_ROOT), env=job_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def _reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sbatch_out.append(line)

    reader = threading.Thread(target=_reader, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        rc = proc.wait()
    reader.join(timeout=5)
    m = _SUBMITTED_RE.search("".join(sbatch_out))
    job_id = m.group(1) if m else None
    if timed_out and job_id is None:
        job_id = _find_job_by_output(out_path)

    diag = ""
    if timed_out or rc != 0:
        diag = slurm_diagnostics(job_id)
    if timed_out:
        rc = rc if rc not in (0, None) else 124
        if job_id:
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        else:
            print(f"run_sbatch: could not determine the job id of {script}; nothing cancelled")

    try:
        output = Path(out_path).read_text(errors="replace")
    except OSError:
        output = ""
    finally:
        try:
            os.unlink(out_path)
        except OSError:
            pass

    if timed_out or rc != 0:
        header = (f"run_sbatch: {'TIMEOUT after %.0fs' % timeout if timed_out else f'exit {rc}'}"
                  f" job={job_id} cmd={' '.join(cmd)}\n--- sbatch ---\n{''.join(sbatch_out)}")
        print(f"{header}\n--- job output ---\n{output}\n--- diagnostics ---\n{diag}")
        if timed_out:
            output += f"\n[run_sbatch] TIMEOUT after {timeout:.0f}s (job {job_id} cancelled)\n{diag}"
    return rc, output
