"""Start ``deinfer-megatron serve`` as a real process (local ranks) and find its ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deinfer_megatron.launch.local import free_port

ROOT = Path(__file__).resolve().parents[2]


class Server:
    """A running ``serve`` command; ``url`` is its base (``…/v1``)."""

    def __init__(self, model: Path, *args: str, log: Path, start_timeout: float = 180) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deinfer_megatron.cli.main", "serve", "--model", str(model),
             "--port", str(self.port), *args],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"serve did not come up in {start_timeout:.0f} s: {log.read_text()[-2000:]}")
            time.sleep(0.5)

    def ranks(self) -> list[int]:
        """The pids of the rank processes the command spawned, in start order (rank 0 first)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                pids.append(int(entry.name))
        return sorted(pids)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
