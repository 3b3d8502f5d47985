"""How a rank's C heap serves large tensors: kept in the heap, not mapped afresh at every use.

PyTorch's CPU tensors come from glibc's ``malloc``. A block above its mmap threshold (128 KiB,
raised automatically up to 32 MiB) is a fresh ``mmap`` that the kernel zero-fills page by page
at first touch and unmaps again at ``free``. A decode step that allocates large temporaries
pays that at every call: Megatron's unfused attention repeats K and V per query head and
rotates the whole cached key (tens of MB a layer at a long context) — several times the step's
own arithmetic (docs/bench/HISTORY.md has the measurements). Whether a process pays it otherwise
depends on its heap's history — so the calibration that prices the layouts and the ranks that
run them would disagree.

``configure()`` sets both thresholds with ``mallopt`` when a process of this project starts
(the command on every rank, and ``parallel.runtime.init_parallel``): no environment before
``exec`` is needed, so it holds under torchrun, the DeepSpeed launcher, Slurm and our own
spawn alike. It is bounded: blocks above ``MMAP_THRESHOLD`` (a prefill's score matrices) are
still mapped and returned, and at most ``TRIM_THRESHOLD`` of free memory stays at the top of
the heap. A user's own choice wins: glibc's variables (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``), another allocator preloaded (jemalloc,
tcmalloc), or ``DEINFER_MEGATRON_MALLOC=system``, which keeps glibc's defaults.

``state()`` names what is in force; the cost table records it (``planning.cost_model.TableKey``)
so that a table timed under one allocator state never prices a job run under another.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

ENV = "DEINFER_MEGATRON_MALLOC"  # "keep" (default) or "system"
CHOICES = ("keep", "system")
MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the heap and are reused
TRIM_THRESHOLD = 512 << 20  # free memory kept at the heap's top before it is given back
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
DEFAULT_STATE = f"keep mmap>{MMAP_THRESHOLD} trim>{TRIM_THRESHOLD}"  # what configure() sets by default
_GLIBC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")

_state: str | None = None  # what configure() found or set, once per process


def _choice() -> str:
    value = os.environ.get(ENV, "keep").strip().lower() or "keep"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not one of {', '.join(CHOICES)}; "
                         f"unset it (keep large blocks in the heap) or set it to 'system' (glibc's defaults)")
    return value


def _user_choice() -> str | None:
    """The allocator setting the user made before this process started, if any."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name in _PRELOADED:
        if name in preload:
            return f"preloaded {name}"
    chosen = [v for v in _GLIBC_VARIABLES if os.environ.get(v)]
    if chosen:
        return "glibc " + " ".join(f"{v}={os.environ[v]}" for v in chosen)
    return None


def _keep_large_blocks() -> str:
    """Set both thresholds in glibc; the state that holds afterwards. The process's own symbols
    (``CDLL(None)``, as ``parallel.shm`` and ``launch.lifetime`` load libc) tell glibc by
    ``gnu_get_libc_version`` — no ``find_library`` subprocess or scan of the interpreter's binary
    at every command's start."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return "system (not glibc: no mallopt)"
    if (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1
            or libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1):
        log.warning("glibc refused the allocator thresholds; large temporaries are mapped afresh at each use")
        return "system (glibc refused mallopt)"
    return DEFAULT_STATE


def configure() -> str:
    """Keep large blocks in this process's heap (bounded) unless the user chose otherwise;
    return ``state()``. Idempotent: the first call decides for the whole process."""
    global _state
    if _state is not None:
        return _state
    choice = _choice()
    user = _user_choice()
    if user is not None:
        _state = user
    elif choice == "system":
        _state = "system"
    else:
        _state = _keep_large_blocks()
    log.debug("allocator: %s", _state)
    return _state


def state() -> str:
    """What serves this process's large blocks (``configure()`` runs first if it has not)."""
    return configure()
