"""Processes of a job end with the job: a rank never outlives the process that started it.

Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) makes the kernel kill a
process the moment its parent exits — also when the parent is killed with ``kill -9``, where
no clean-up code of the parent can run. It is set first thing in every rank (spawned locally,
or started by torchrun / the DeepSpeed launcher / srun) and in a launcher the CLI starts.
Elsewhere than Linux it is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent exits.

    With ``expected_parent``, exit at once if that parent is already gone (it may have died
    before the signal was armed, and then the signal would never come).
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


PARENT_PID_ENV = "DEINFER_MEGATRON_PARENT_PID"
SCRATCH_ENV = "DEINFER_MEGATRON_SCRATCH"


def watch_process(pid: int, scratch: str | None = None) -> None:
    """End this process as soon as process ``pid`` exits (a daemon thread waits on it).

    For ranks whose direct parent is a launcher that may outlive the command that started it
    (the DeepSpeed launcher's ``launch.py``): the command passes its pid in
    ``DEINFER_MEGATRON_PARENT_PID``. ``scratch`` is the command's scratch folder (the
    launcher's logs), removed on the way out: a command killed with ``kill -9`` cannot remove it
    itself. A pidfd is waited on where Linux has one (no polling, no pid reuse); elsewhere the
    pid is polled twice a second.
    """
    import select
    import shutil
    import threading
    import time

    def wait_then_exit() -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            select.select([fd], [], [])
        else:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                time.sleep(0.5)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=wait_then_exit, name="parent-watchdog", daemon=True).start()
