"""Rank 0's result back to the command that started a launcher, past the launcher's own output.

``generate --launcher torchrun|deepspeed --json`` starts the launcher as a child whose stdout
goes to stderr (DeepSpeed's launcher logs to stdout); global rank 0 then sends its result here
instead of printing it, and the command prints the JSON document alone on its stdout.

The channel is a Linux abstract Unix socket named by a random token: nothing is created on
disk (so nothing is left behind by a ``kill -9``), and only a process of the same user is
accepted (``SO_PEERCRED``). The payload is JSON, never pickle.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import uuid
from typing import Any

ENV = "DEINFER_MEGATRON_REPORT_SOCKET"


class ReportListener:
    """Listens for one report; ``env`` is what the launcher's environment must carry."""

    def __init__(self) -> None:
        self.name = f"deinfer-megatron-report-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(4)
        self._result: Any = None
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def env(self) -> dict[str, str]:
        return {ENV: self.name}

    def start(self) -> None:
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                _, uid, _ = struct.unpack("3i", creds)
                if uid != os.getuid():
                    continue
                chunks = []
                while block := conn.recv(1 << 16):
                    chunks.append(block)
            try:
                self._result = json.loads(b"".join(chunks))
            except ValueError:
                continue
            return

    def result(self, timeout: float = 5.0) -> Any:
        """The report (None if none came), after the launcher has exited."""
        self._thread.join(timeout)
        self._sock.close()
        return self._result


def send_report(doc: Any) -> bool:
    """Send ``doc`` to the listening command, if one asked for it; False when none did."""
    name = os.environ.get(ENV)
    if not name:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect("\0" + name)
        sock.sendall(json.dumps(doc).encode())
    return True
