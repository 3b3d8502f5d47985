"""Re-run a command as N local ranks under torchrun or the DeepSpeed launcher.

``generate --launcher torchrun|deepspeed`` starts the launcher as a child process (each rank it
starts runs the same command, finds the launcher's variables and joins), and stays the one
process the user talks to:

* the launcher gets its own session, so Ctrl-C reaches only this command, which then stops the
  whole launcher tree and prints one line;
* every process below dies with this one: the launcher through the parent-death signal, the
  ranks through a watchdog on this pid (``lifetime.watch_process``) — the DeepSpeed launcher
  has an intermediate process that would otherwise outlive it;
* with ``report=True`` the launcher's output (stdout included: DeepSpeed logs there) is
  forwarded to stderr, and rank 0's result comes back through ``launch.report``;
* what the launcher writes (torchrun keeps its logs in a temporary folder for good) goes to a
  scratch folder that is removed when the job ends — by this command, or by the ranks'
  watchdog when this command was killed;
* the ranks run this command's own code (``same_code_env``): the launcher would otherwise let
  its own ``sys.path`` choose — DeepSpeed's ranks run the environment's ``deinfer-megatron``
  script (the installed package: an editable install's checkout), torchrun's ``-m`` puts the
  working directory first — so a command run from another checkout (a worktree, a copy) would
  report what other code computed.
"""

from __future__ import annotations

import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any, Mapping

from deinfer_megatron.launch.lifetime import PARENT_PID_ENV, SCRATCH_ENV, die_with_parent
from deinfer_megatron.launch.local import LOOPBACK, free_port
from deinfer_megatron.launch.report import ReportListener

LAUNCHERS = ("torchrun", "deepspeed")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding this deinfer_megatron


def _command(launcher: str, world: int, argv: list[str], port: int, scratch: str) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                "--max-restarts=0", f"--master-addr={LOOPBACK}", f"--master-port={port}",
                f"--log-dir={scratch}", "-m", "deinfer_megatron.cli.main", *argv]
    if launcher == "deepspeed":
        exe, cli = (_beside_python(name) for name in ("deepspeed", "deinfer-megatron"))
        return [exe, f"--num_gpus={world}", "--no_local_rank", f"--master_addr={LOOPBACK}",
                f"--master_port={port}", cli, *argv]
    raise ValueError(f"unknown launcher {launcher!r}; choose one of {', '.join(LAUNCHERS)}")


def same_code_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``PYTHONPATH`` and ``PYTHONSAFEPATH`` that make every Python process below the launcher
    import the ``deinfer_megatron`` this module belongs to.

    ``PYTHONSAFEPATH`` keeps Python from putting a script's folder or the working directory first
    on ``sys.path`` (torchrun's ``python -m`` would put the working directory there). A package
    run from a checkout (a worktree, an editable install, ``PYTHONPATH``) also puts the folder
    holding it first on ``PYTHONPATH``, ahead of the caller's entries; an installed one is what
    the ranks find anyway (an earlier entry holding another copy would have been imported here).
    """
    rest = environ.get("PYTHONPATH", "")
    sites = {Path(p).resolve() for p in (*site.getsitepackages(), site.getusersitepackages())}
    path = rest if PACKAGE_ROOT in sites else os.pathsep.join(p for p in (str(PACKAGE_ROOT), rest) if p)
    return {**({"PYTHONPATH": path} if path else {}), "PYTHONSAFEPATH": "1"}


def _beside_python(name: str) -> str:
    """The script ``name`` of this interpreter's environment (else the first on PATH)."""
    own = Path(sys.executable).with_name(name)
    return str(own) if own.is_file() else (shutil.which(name) or name)


def _forward(src: IO[bytes], dst: IO[str], muted: threading.Event) -> None:
    for line in iter(src.readline, b""):
        if not muted.is_set():
            dst.write(line.decode(errors="replace"))
            dst.flush()


def run_under_launcher(launcher: str, world: int, argv: list[str], *, report: bool) -> tuple[int, Any]:
    """Run ``deinfer-megatron <argv>`` on ``world`` ranks under ``launcher``.

    Returns the launcher's exit status and — with ``report`` — rank 0's result (None if it
    sent none). Raises ``KeyboardInterrupt`` after stopping everything on Ctrl-C.
    """
    scratch = tempfile.mkdtemp(prefix="deinfer-launch-")
    try:
        return _run(launcher, world, argv, report, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(launcher: str, world: int, argv: list[str], report: bool, scratch: str) -> tuple[int, Any]:
    listener = ReportListener() if report else None
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "GLOO_SOCKET_IFNAME": "lo", PARENT_PID_ENV: str(os.getpid()), SCRATCH_ENV: scratch,
           **same_code_env(os.environ), **(listener.env if listener else {})}
    proc = subprocess.Popen(_command(launcher, world, argv, free_port(), scratch), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=die_with_parent)
    muted = threading.Event()
    streams = [threading.Thread(target=_forward, args=(proc.stdout, sys.stderr if report else sys.stdout, muted)),
               threading.Thread(target=_forward, args=(proc.stderr, sys.stderr, muted))]
    for t in streams:
        t.start()
    if listener is not None:
        listener.start()
    try:
        code = proc.wait()
    except BaseException:
        muted.set()  # the launcher's shutdown messages are noise once the user has stopped it
        _stop_group(proc)
        raise
    finally:
        for t in streams:
            t.join(timeout=5)
    return code, (listener.result() if listener else None)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher's process group, give it 10 s to stop, then SIGKILL what is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10.0)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
