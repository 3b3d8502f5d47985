"""The command line as users run it: one subprocess per command, several started at once.

A command's start (importing torch and Megatron) costs seconds of one core; checks of many bad
inputs each pay it, so they run side by side and the suite waits for the slowest, not the sum.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

CLI = [sys.executable, "-m", "deinfer_megatron.cli.main"]


def run_cli(args: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``deinfer-megatron *args`` with one thread per process (as the suite runs) and ``env`` added."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def run_cli_together(commands: Sequence[tuple[Sequence[str], Mapping[str, str]]],
                     timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Every ``(args, env)`` at once; the results in the commands' order."""
    with ThreadPoolExecutor(max(1, len(commands))) as pool:
        return list(pool.map(lambda c: run_cli(c[0], c[1], timeout), commands))
