"""Running the CLI as a user does, and proving it cleaned up after itself.

``Job`` starts ``deinfer-megatron ...`` as a real process with a marker in its environment and
a private ``TMPDIR``. Every process of the job — ranks, launchers, helpers — inherits the
marker, so after the command ends ``survivors()`` finds any that outlived it by scanning
``/proc``, whatever session or parent they ended up with. ``snapshot`` records the folders a
case involves, to show that nothing outside the command's own output changed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

CLI = [sys.executable, "-m", "deinfer_megatron.cli.main"]
MARKER = "DEINFER_ROBUSTNESS_JOB"


def processes_with(marker: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def listening_addresses(pid: int) -> list[str]:
    """``ip:port`` of every TCP socket process ``pid`` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                addr, port = fields[1].split(":")
                out.append(f"{_decode_addr(addr, width)}:{int(port, 16)}")
    return out


def _decode_addr(hexaddr: str, width: int) -> str:
    import ipaddress

    raw = bytes.fromhex(hexaddr)
    words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]  # each 32-bit word is little-endian
    return str(ipaddress.ip_address(b"".join(words)))


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    survivors: list[int]

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.strip().splitlines() if line.strip()]


def _as_from_a_terminal() -> None:
    """In the child before exec: Ctrl-C's default disposition and an empty blocked mask, as a
    shell gives a foreground command. A test process may have inherited SIGINT ignored or
    blocked (a background runner, a thread that spawned us); the command must not inherit that,
    or the Ctrl-C test measures the runner instead of the command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


class Job:
    """One CLI command as a process of its own (not yet waited on)."""

    def __init__(self, *args: str, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.marker = uuid.uuid4().hex
        self.tmpdir = tmp / f"TMPDIR-{self.marker[:8]}"
        self.tmpdir.mkdir(parents=True)
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", MARKER: self.marker, "TMPDIR": str(self.tmpdir),
                    **(env or {})}
        self.proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=full_env, start_new_session=True, preexec_fn=_as_from_a_terminal)

    def signal_state(self) -> str:
        """The command's ignored and blocked signal masks (``/proc``), for a failure message."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        except OSError:
            return "gone"
        return ", ".join(line for line in status if line.startswith(("SigIgn", "SigBlk")))

    def processes(self) -> list[int]:
        return processes_with(self.marker)

    def wait_for(self, count: int, timeout: float = 120.0) -> list[int]:
        """Wait until at least ``count`` processes of the job run besides the command itself."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            others = [p for p in self.processes() if p != self.proc.pid and _is_python(p)]
            if len(others) >= count:
                return others
            if self.proc.poll() is not None:
                raise AssertionError(f"the command ended early: {self.proc.stderr.read()[-3000:]}")
            time.sleep(0.3)
        raise AssertionError(f"fewer than {count} processes started within {timeout} s")

    def finish(self, timeout: float = 600.0, grace: float = 10.0) -> Result:
        """Wait for the command, then for its processes to go (up to ``grace`` s); kill any
        that survive (reported in the result) so that one failing case does not leak."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, err = self.proc.communicate()
        deadline = time.monotonic() + grace
        alive = self.processes()
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = self.processes()
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        leftovers = sorted(p.name for p in self.tmpdir.iterdir())
        if leftovers:
            err += f"\n[harness] left in TMPDIR: {leftovers}"
        return Result(self.proc.returncode, out, err, alive + ([-1] if leftovers else []))


def _is_python(pid: int) -> bool:
    try:
        return b"python" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def run_cli(*args: str, tmp: Path, env: dict[str, str] | None = None, timeout: float = 600.0) -> Result:
    return Job(*args, tmp=tmp, env=env).finish(timeout=timeout)


def snapshot(*roots: Path) -> dict[str, tuple]:
    """Every path under ``roots`` → (kind, size, mtime, mode): what a command must not change."""
    state: dict[str, tuple] = {}
    for root in roots:
        if not root.exists():
            state[str(root)] = ("absent",)
            continue
        for path in [root, *sorted(root.rglob("*"))]:
            st = path.lstat()
            kind = "dir" if path.is_dir() and not path.is_symlink() else "file"
            state[str(path)] = (kind, st.st_size if kind == "file" else 0, st.st_mtime_ns, st.st_mode)
    return state


def assert_one_line_error(result: Result, *needles: str, code: int = 2) -> str:
    """Exit status ``code``, one stderr line containing every needle, no survivors."""
    assert result.code == code, (result.code, result.stderr[-3000:])
    assert len(result.lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.lines[0], (needle, result.lines[0])
    assert not result.survivors, (result.survivors, result.stderr[-2000:])
    return result.lines[0]


def assert_unchanged(before: dict[str, tuple], after: dict[str, tuple], allowed: Iterable[Path] = ()) -> None:
    allowed = [str(p) for p in allowed]

    def free(path: str) -> bool:
        return any(path == a or path.startswith(a + os.sep) for a in allowed)

    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p) and not free(p))
    assert not changed, f"changed outside the command's output: {changed[:10]}"
