"""All-reduce and all-gather between the ranks of one node through a shared-memory segment.

Why: on CPU, gloo sends even a 2-rank all-reduce of a few KiB through loopback TCP (tens of
microseconds per call, more on a busy host), and a decode step issues dozens of them. Ranks on
one node can instead copy their tensor into a shared segment, raise a flag, and read each
other's copies — a few microseconds plus the memory traffic. DeepSpeed's shm op crashes under
torchrun on the project's machines and oneCCL's bindings do not install for this torch, so this
is the project's own, small implementation.

The segment (a file in ``/dev/shm``, created by the group's first local rank at group setup and
unlinked as soon as every member has mapped it, so a killed job leaves nothing behind) holds

- a header: per member a 64-byte line with its arrival counter, its pid and the start time of
  that pid (a recycled pid is not mistaken for the peer);
- two buffers (alternating by call) of one slot per member, ``slot_bytes`` each.

A segment left by a creator killed in the moment between creating and unlinking it is removed
by the next job that creates one (``remove_stale``: the name carries the creator's pid).

A collective with sequence number ``s`` uses buffer ``s % 2``: a member first waits until every
peer has arrived at ``s - 1`` (then it has finished reading buffer ``s % 2`` from call
``s - 2``), copies its data into its slot, publishes ``s`` and waits for every peer's ``s``.
Then each member reads all slots in member order — all-reduce sums them in that order, so every
member gets the same bits. Tensors larger than a slot go through in chunks. A wait spins for a
few tens of microseconds, then blocks in the kernel on the peer's futex word (woken when the
peer arrives: on a busy machine a sleeping waiter gets the core back as soon as there is
something to do, as with a socket, and a spinning one would take it from the peer); every few
milliseconds it looks at the peer's pid, and a dead peer or one that does not arrive within
``timeout_s`` ends the wait with a one-line ``RuntimeError`` naming it. Flags are plain stores on x86-64's ordered memory model (other
architectures would need fences; ``supported()`` says where the backend is offered).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_LINE = 64  # bytes per member in the header: counter, pid, pid start time, joined, futex word
_WORD = 32  # byte offset of the 32-bit futex word in a member's line
_SPIN = 300  # busy polls (tens of microseconds) before blocking in the kernel
_CHECK_EVERY_S = 0.005  # how long one futex wait lasts: a waiting member then looks at the peer's pid
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the word lives in a shared mapping
DEFAULT_SLOT_BYTES = 4 << 20
SHM_DIR = Path("/dev/shm")


def supported() -> bool:
    """Shared-memory collectives run where the flags' ordering holds (x86-64 Linux) and
    ``/dev/shm`` exists."""
    return platform.machine() in ("x86_64", "AMD64") and SHM_DIR.is_dir()


def new_segment_name() -> str:
    """A name no other job uses (one per tensor-parallel group and job)."""
    return f"deinfer-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def remove_stale() -> list[Path]:
    """Remove segments whose creator is gone (killed between creating and unlinking one);
    only names this module makes (``deinfer-tp-<pid>-<id>``) are considered."""
    removed = []
    for path in SHM_DIR.glob("deinfer-tp-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and _start_time(int(pid)) is None:
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot); None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long
_CHECK_TIMEOUT = _Timespec(0, int(_CHECK_EVERY_S * 1e9))


def _futex_wait(addr: int, expected: int) -> None:
    """Sleep while the 32-bit word at ``addr`` equals ``expected`` (at most ``_CHECK_EVERY_S``)."""
    _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int(expected),
                  ctypes.byref(_CHECK_TIMEOUT), None, 0)


def _futex_wake(addr: int) -> None:
    _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, ctypes.c_int(2**31 - 1), None, None, 0)


@dataclass(frozen=True)
class _Peer:
    member: int
    pid: int
    started: int


class ShmCollectives:
    """Collectives among ``size`` local ranks of one tensor-parallel group over one segment.

    Every member constructs one with the same ``name``, its own ``member`` index (its order in
    the group) and ``create=True`` on exactly one of them, which must construct first (the
    others wait up to ``join_timeout_s``, default ``timeout_s``, for the file). ``timeout_s``
    bounds each wait for a peer inside a collective. ``names`` are how errors call the members
    (e.g. "tensor-parallel rank 1"). Construction returns once every member has joined.
    """

    def __init__(self, name: str, member: int, size: int, *, create: bool, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 timeout_s: float = 300.0, join_timeout_s: float | None = None,
                 names: list[str] | None = None) -> None:
        if not 0 <= member < size:
            raise ValueError(f"shared-memory member {member} is outside a group of {size}")
        if slot_bytes < 64 or slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes}")
        self.member, self.size, self.slot_bytes, self.timeout_s = member, size, slot_bytes, timeout_s
        self.join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
        self.names = names or [f"member {m}" for m in range(size)]
        self.path = SHM_DIR / name
        header = size * _LINE
        total = header + 2 * size * slot_bytes
        fd = self._open(create, total)
        try:
            self._map = mmap.mmap(fd, total)
        except BaseException:
            if create:
                self.unlink()
            raise
        finally:
            os.close(fd)
        self._header = np.frombuffer(self._map, dtype=np.int64, count=header // 8).reshape(size, _LINE // 8)
        self._words = np.frombuffer(self._map, dtype=np.int32, count=header // 4).reshape(size, _LINE // 4)[:, _WORD // 4]
        base = self._header.ctypes.data
        self._word_addr = [base + m * _LINE + _WORD for m in range(size)]
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=header, count=2 * size * slot_bytes)
        self._slots = [[self._data[(b * size + m) * slot_bytes : (b * size + m + 1) * slot_bytes]
                        for m in range(size)] for b in range(2)]
        self._seq = 0
        pid = os.getpid()
        started = _start_time(pid)
        self._header[member, 1] = pid
        self._header[member, 2] = started if started is not None else -1
        self._header[member, 0] = 0  # joined; arrival counters start at 0
        self._header[member, 3] = 1  # joined flag, written last
        try:
            self._peers = self._wait_for_members()
        except BaseException:
            if create:
                self.unlink()  # a failed setup leaves nothing in /dev/shm
            self.close()
            raise

    # -------------------------------------------------------------- setup and teardown

    def _open(self, create: bool, total: int) -> int:
        if create:
            remove_stale()
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, total)
            except OSError as err:
                os.close(fd)
                self.unlink()
                raise RuntimeError(f"cannot make a {total >> 20} MiB shared-memory segment in {SHM_DIR} ({err}); "
                                   "free space there or pass --collectives process-group") from None
            return fd
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"shared-memory segment {self.path} was not created within "
                                       f"{self.join_timeout_s:g} s by {self.names[0]}") from None
                time.sleep(0.001)
                continue
            if os.fstat(fd).st_size == total:
                return fd
            os.close(fd)  # created but not yet sized
            time.sleep(0.001)

    def _wait_for_members(self) -> list[_Peer]:
        deadline = time.monotonic() + self.join_timeout_s
        while not all(self._header[m, 3] == 1 for m in range(self.size)):
            if time.monotonic() > deadline:
                missing = [self.names[m] for m in range(self.size) if self._header[m, 3] != 1]
                raise RuntimeError(f"shared-memory collectives: {', '.join(missing)} did not join within "
                                   f"{self.join_timeout_s:g} s")
            time.sleep(0.0005)
        return [_Peer(m, int(self._header[m, 1]), int(self._header[m, 2]))
                for m in range(self.size) if m != self.member]

    def unlink(self) -> None:
        """Remove the segment's name (the mapping stays valid); called once all members mapped it."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap the segment (the tensors viewing it must not be used afterwards)."""
        self._header = self._words = None  # type: ignore[assignment]
        self._data = self._slots = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process

    # -------------------------------------------------------------- the protocol

    def _slot(self, buf: int, member: int) -> torch.Tensor:
        return self._slots[buf][member]

    def _wait(self, seq: int, op: str) -> None:
        """Until every peer's counter reaches ``seq``; a dead or absent peer raises.

        A short spin catches a peer that is about to arrive; then the wait blocks in the kernel on
        the peer's futex word (woken by its ``_publish``), ``_CHECK_EVERY_S`` at a time, so that a
        waiting rank neither burns its core on a busy machine nor sleeps past the peer's arrival.
        """
        header, words = self._header, self._words
        for peer in self._peers:
            m = peer.member
            polls = 0
            while header[m, 0] < seq and polls < _SPIN:
                polls += 1
            if header[m, 0] >= seq:
                continue
            deadline = time.monotonic() + self.timeout_s
            while True:
                word = int(words[m])
                if header[m, 0] >= seq:  # read after the word: a publish in between changes the word
                    break
                _futex_wait(self._word_addr[m], word)
                if header[m, 0] >= seq:
                    break
                self._check_alive(peer, op)
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"shared-memory {op}: {self.names[m]} (pid {peer.pid}) did not arrive "
                        f"within {self.timeout_s:g} s; the job cannot continue")

    def _check_alive(self, peer: _Peer, op: str) -> None:
        if peer.started < 0:
            return  # no /proc: nothing to check beyond the timeout
        if _start_time(peer.pid) != peer.started:
            raise RuntimeError(f"shared-memory {op}: {self.names[peer.member]} (pid {peer.pid}) died during "
                               "the collective; the job cannot continue")

    def _publish(self, seq: int) -> None:
        """Arrive at ``seq``: the counter, then the futex word, then wake whoever waits on it."""
        self._header[self.member, 0] = seq
        self._words[self.member] = seq & 0x7FFFFFFF
        _futex_wake(self._word_addr[self.member])

    def _round(self, chunk: torch.Tensor, op: str) -> int:
        """Publish ``chunk`` (bytes) in this member's slot of a new call; return its buffer."""
        self._seq += 1
        seq, buf = self._seq, self._seq % 2
        self._wait(seq - 1, op)
        self._slot(buf, self.member)[: chunk.numel()].copy_(chunk)
        self._publish(seq)
        self._wait(seq, op)
        return buf

    def _chunks(self, nbytes: int, itemsize: int) -> list[tuple[int, int]]:
        step = self.slot_bytes - self.slot_bytes % itemsize
        return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)] or [(0, 0)]

    @torch.no_grad()  # like torch.distributed's collectives: data movement, not autograd ops
    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` (contiguous, CPU) over the members in place; every member gets the same bits."""
        if self.size == 1:
            return
        flat = x.view(-1)
        raw = flat.view(torch.uint8)
        item = x.element_size()
        for a, b in self._chunks(raw.numel(), item):
            buf = self._round(raw[a:b], "all-reduce")
            out = flat[a // item : b // item]
            slots = [self._slot(buf, m)[: b - a].view(x.dtype) for m in range(self.size)]
            torch.add(slots[0], slots[1], out=out)
            for s in slots[2:]:
                out.add_(s)

    @torch.no_grad()
    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out`` (``[size * x.shape[0], ...]``, contiguous) gets every member's ``x`` in member order."""
        raw = x.contiguous().view(-1).view(torch.uint8)
        dst = out.view(-1).view(torch.uint8)
        n = raw.numel()
        for a, b in self._chunks(n, x.element_size()):
            buf = self._round(raw[a:b], "all-gather")
            for m in range(self.size):
                dst[m * n + a : m * n + b].copy_(self._slot(buf, m)[: b - a])
