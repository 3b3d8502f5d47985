"""Output folders that are either complete or absent, and never replace what the user owns.

A command that writes a folder (``decompose``, ``fetch-model``):

1. ``claim_output`` refuses an ``--out`` that is a file, the input itself (or a folder holding
   it), or an existing non-empty folder — unless ``--overwrite`` is given *and* the folder is a
   model folder this project wrote (the caller says how to recognise one). An empty folder may
   be used.
2. ``staged_folder`` creates a hidden sibling ``.<name>.tmp-<host>-<pid>-<id>``, lets the
   caller fill it, and publishes it with one rename. When a previous folder is replaced the two
   are swapped atomically (``renameat2(RENAME_EXCHANGE)``), so at no moment is ``--out``
   missing; the old contents, now under the temporary name, are then removed. Any error removes
   the temporary folder.
3. ``remove_stale`` deletes temporaries left by runs that were killed (``kill -9``, power loss):
   their name carries the host and pid of the run that made them, so a run still in progress
   (same host, live pid) or on another host sharing the file system is left alone.

Nothing here removes a path it did not itself name ``.tmp-``/``.old-`` for this ``--out``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import shutil
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Iterator, Sequence

from deinfer_megatron.files import failpoints

log = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def temp_name(out: Path, kind: str = "tmp") -> Path:
    """``out``'s hidden sibling for this process: ``.<name>.<kind>-<host>-<pid>-<id>``."""
    return out.with_name(f".{out.name}.{kind}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<host>[^-]+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is the unfinished temporary folder of some run (never a model)."""
    return _TEMP_RE.match(Path(path).name) is not None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(out: Path) -> list[Path]:
    """Remove ``out``'s temporaries whose run (this host, that pid) is gone; return them."""
    out = Path(out)
    removed = []
    if not out.parent.is_dir():
        return removed
    for sibling in out.parent.iterdir():
        m = _TEMP_RE.match(sibling.name)
        if m is None or m["name"] != out.name or m["host"] != _host() or _alive(int(m["pid"])):
            continue
        shutil.rmtree(sibling, ignore_errors=True)
        log.warning("removed %s, left behind by a run that was killed", sibling)
        removed.append(sibling)
    return removed


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def claim_output(
    out: Path,
    *,
    overwrite: bool,
    is_ours: Callable[[Path], bool],
    inputs: Sequence[Path] = (),
    flag: str = "--out",
) -> None:
    """Refuse an output path that would destroy something the command did not make.

    Raises:
        ValueError: ``out`` is a file, the input (or contains it), a non-empty folder without
            ``overwrite``, or — with ``overwrite`` — a folder that is not one of ours.
    """
    out = Path(out)
    resolved = out.resolve()
    for src in inputs:
        if _inside(Path(src).resolve(), resolved):
            raise ValueError(f"{flag} {out} is (or contains) the input {src}; choose another {flag}")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ValueError(f"{flag} {out} exists and is not a folder; choose another {flag}")
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ValueError(f"{flag} {out} exists and is not empty; choose another {flag}, "
                         "or pass --overwrite to replace a model folder made by deinfer-megatron")
    if not is_ours(out):
        raise ValueError(f"{flag} {out} is not a model folder made by deinfer-megatron; "
                         "refusing to replace it (choose another --out)")


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where the kernel or file system cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _publish(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)
        return
    if not any(out.iterdir()):
        os.rmdir(out)  # an empty folder holds nothing to lose
        os.rename(tmp, out)
        return
    if _exchange(tmp, out):
        failpoints.point("staging.after-publish")
        shutil.rmtree(tmp, ignore_errors=True)  # the previous contents, now under tmp's name
        return
    old = temp_name(out, "old")
    os.rename(out, old)
    os.rename(tmp, out)
    failpoints.point("staging.after-publish")
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(out: Path, *, before_publish: Callable[[], None] | None = None) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out``; on success it becomes ``out``.

    Call ``claim_output`` first — this replaces a non-empty ``out`` without asking — and pass
    it again as ``before_publish`` when something may have appeared at ``out`` meanwhile.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    tmp = temp_name(out)
    tmp.mkdir()
    try:
        yield tmp
        if before_publish is not None:
            before_publish()
        failpoints.point("staging.before-publish")
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` both sets and returns it, a
    race with other threads creating files): ``/proc/self/status`` on Linux, else set and
    restore."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write the file ``path`` through a temporary sibling and a rename: readers never see half
    a file (reports, cost tables, cached text). The file gets the mode ``open`` would give it —
    the mode of the file it replaces, else 0666 less the umask — not ``mkstemp``'s private 0600."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent or Path("."), prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
