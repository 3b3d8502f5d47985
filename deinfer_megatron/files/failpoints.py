"""Named points where the robustness suite kills a command, to prove that a crash there leaves
nothing half-written and that a rerun succeeds.

``DEINFER_MEGATRON_KILL_AT=<name>`` makes the process SIGKILL itself when it reaches the point
of that name (e.g. ``staging.before-publish``). Unset — always, outside the tests — a point is
one dictionary lookup. A kill, not an exception: nothing of the program's own clean-up runs,
exactly like ``kill -9`` or a power cut.
"""

from __future__ import annotations

import os
import signal

ENV = "DEINFER_MEGATRON_KILL_AT"


def point(name: str) -> None:
    """Kill this process here if the environment names this point."""
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
