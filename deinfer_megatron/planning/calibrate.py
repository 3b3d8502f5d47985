"""Measure a ``CostTable`` on this machine in a few seconds: a small GEMM grid (fp32, bf16), a
streaming copy for memory bandwidth, and all-reduce / all-gather between two forked processes
over the shared-memory transport the job's local ranks use (``parallel.shm``).

Two statistics, for two uses. The grid's rates and the copy bandwidth are the best of a few
repetitions: they bound a step (``bench --roofline``), and a busy machine only ever adds time.
What predicts a step is timed as the step meets it, typical rather than best: the matrix products
and attention per shape are the median of ``ROUNDS`` passes (``measure_shapes``,
``measure_attention``), as ``bench`` reports the median step, and a collective's latency and
bandwidth are the line through its median time at a small and a large message, each call made
after ``CacheFlush``, as a decode step's collectives follow a block that streamed its weights.

Matrix products are timed per shape as a plan needs them, every call reading its weights from
memory as a decode step does (a model's weights on one rank outgrow the last-level cache, which
two ranks also share): the weights are views at successive offsets of a pool larger than the
last-level cache, so a view was last touched a whole pool ago. The pool is filled once per call
of ``measure_shapes``; each (shape, rows) then costs ``ROUNDS`` passes over it. The attention
over a decode step's cache is timed alike: each core as its block calls it, K/V views cycled
through a pool past the last-level cache. docs/INFERENCE.md (``--layout auto``) has the
measurements behind these choices.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from deinfer_megatron.layers.core_attention import standalone_core
from deinfer_megatron.layers.costs import Attend, Gemm
from deinfer_megatron.parallel import shm
from deinfer_megatron.parallel.shm import ShmCollectives
from deinfer_megatron.planning.cost_model import GEMM_DTYPES, CostTable, TableKey

GEMM_TOKENS = (1, 8, 64, 256)
GEMM_SIDES = (256, 1024, 2048)  # weights n × n
SMALL, LARGE = 64, 1 << 18  # collective message sizes in float32 elements
COLD_CALLS = 15  # timed collectives per message size, each after a cache flush


FLUSH_BYTES = 32 << 20  # what a block streams before the collective or the Python that follows it


class CacheFlush:
    """Streams ``FLUSH_BYTES`` of weights through one matrix product, as a decode step's block does
    between two collectives: what follows runs with the caches (and the code paths of the
    framework) as cold as in a step of a model whose blocks outgrow a core's caches — the models
    this project serves. ``FLUSH_BYTES`` is many times a core's L2 and about one llama-1b-shape
    block per rank."""

    def __init__(self, nbytes: int = FLUSH_BYTES) -> None:
        self.weights = torch.empty(max(1, nbytes // 4 // 1024), 1024).uniform_(-1.0, 1.0)
        self.x = torch.ones(1, 1024)

    def __call__(self) -> None:
        """Stream the weights (a timer leaves this out by timing around it)."""
        with torch.no_grad():
            F.linear(self.x, self.weights)


def cold_median(call: Callable[[], Any], sync: Callable[[], Any], flush: Callable[[], Any] | None,
                calls: int) -> float:
    """Median seconds of ``call`` over ``calls`` timed calls after one warm-up, each after
    ``flush`` (a ``CacheFlush``; None: none) and ``sync`` (a barrier of every member, so that the
    timed call waits for nobody). Every member makes the same calls: a fixed count, never a time
    budget, which would differ by member and leave a collective without its peers."""
    call()
    times = []
    for _ in range(calls):
        if flush is not None:
            flush()
        sync()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def line_through(kind: str, sizes: tuple[int, int], seconds: tuple[float, float], members: int) -> list[float]:
    """``[latency s, bytes/s]`` of a collective from its times at two float32 message sizes: the
    line through them, an all-gather priced by its gathered bytes (``members`` × its input), as
    the cost model prices it; a latency of at least 0.1 µs."""
    scale = members if kind == "all_gather" else 1
    bandwidth = 4 * scale * (sizes[1] - sizes[0]) / max(seconds[1] - seconds[0], 1e-9)
    return [max(seconds[0] - 4 * scale * sizes[0] / bandwidth, 1e-7), bandwidth]


def _best(fn: Callable[[], Any], repeats: int, *, budget_s: float = 0.3) -> float:
    fn()  # warm-up
    best = float("inf")
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


def measure_gemm(dtype: torch.dtype) -> list[list[float]]:
    rows = []
    for n in GEMM_SIDES:
        w = torch.randn(n, n).to(dtype)
        for m in GEMM_TOKENS:
            x = torch.randn(m, n).to(dtype)
            seconds = _best(lambda: x @ w, 5)
            rows.append([float(m), float(n * n), 2.0 * m * n * n / seconds])
    return rows


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 (sysfs); 32 MiB where the kernel does not say."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=32 << 20)


MAX_POOL = 1 << 30  # bytes: the pool never exceeds this, whatever the cache reports
ROUNDS = 5  # passes per (shape, rows) or attention case, one per round over all of them; the median is kept
MAX_CALLS = 512  # per pass: small weights cycle over a part of the pool (they fit a cache anyway)


def _product(gemm: Gemm) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The call the layers make for ``gemm`` (``x @ W``, ``bmm`` of sections, ``F.linear``)."""
    if gemm.transposed:
        return lambda x, w: F.linear(x, w)
    if gemm.count > 1:
        return torch.bmm
    return torch.matmul


def measure_shapes(dtype: str, needs: Iterable[tuple[Gemm, int]], *, threads: int) -> dict[Gemm, list[list[float]]]:
    """Per shape, ``[rows, seconds]`` of each requested row count, weights from memory (module
    docstring): the median of ``ROUNDS`` passes, each the mean over its calls, the rounds going
    over every case in turn so that the passes of one case lie seconds apart."""
    torch.set_num_threads(threads)
    wanted: dict[Gemm, set[int]] = {}
    for gemm, rows in needs:
        wanted.setdefault(gemm, set()).add(int(rows))
    if not wanted:
        return {}
    t = getattr(torch, dtype)
    elem = torch.empty((), dtype=t).element_size()
    largest = max(g.weights for g in wanted)
    pool_bytes = min(MAX_POOL, max(3 * last_level_cache_bytes() // 2, 3 * largest * elem))
    used = max(min(MAX_CALLS, pool_bytes // elem // g.weights) * g.weights for g in wanted)
    pool = torch.empty(max(used, largest), dtype=t)  # no larger than the passes read
    pool.uniform_(-1.0, 1.0)  # no denormals, no NaNs
    cases = []
    for gemm, row_counts in wanted.items():
        shape = (gemm.n, gemm.k) if gemm.transposed else (gemm.k, gemm.n)
        if gemm.count > 1:
            shape = (gemm.count, *shape)
        copies = max(1, min(MAX_CALLS, pool.numel() // gemm.weights))
        views = [pool[i * gemm.weights:(i + 1) * gemm.weights].view(shape) for i in range(copies)]
        for rows in sorted(row_counts):
            x = torch.randn(*((gemm.count,) if gemm.count > 1 else ()), rows, gemm.k).to(t)
            cases.append((gemm, rows, _product(gemm), x, views))
    passes: dict[tuple[Gemm, int], list[float]] = {}
    with torch.no_grad():
        for _ in range(ROUNDS):  # rounds over every case: a burst of load elsewhere hits one only
            for gemm, rows, op, x, views in cases:
                for w in views[-2:]:
                    op(x, w)  # warm-up on the pass's last weights: its first are the least recent
                start = time.perf_counter()
                for w in views:
                    op(x, w)
                passes.setdefault((gemm, rows), []).append((time.perf_counter() - start) / len(views))
    out: dict[Gemm, list[list[float]]] = {}
    for (gemm, rows), seconds in sorted(passes.items()):
        out.setdefault(gemm, []).append([float(rows), statistics.median(seconds)])
    return out


def measure_attention(dtype: str, cases: Iterable[tuple[Attend, int, int]], *,
                      threads: int) -> dict[Attend, list[list[float]]]:
    """Per attend, ``[batch, context, seconds]`` of each (attend, batch, context): one decode
    token's attention through the real core (``layers.core_attention.standalone_core``) over
    K/V views ``[context, batch, kv_heads, d]`` of a pool 1.5 times the last-level cache (at most
    ``MAX_CALLS`` views, two at least), the median of ``ROUNDS`` passes' means."""

    torch.set_num_threads(threads)
    t = getattr(torch, dtype)
    elem = torch.empty((), dtype=t).element_size()
    llc = last_level_cache_bytes()
    out: dict[Attend, list[list[float]]] = {}
    with torch.no_grad():
        for attend, batch, context in sorted(set(cases)):
            half = context * batch * attend.kv_heads * attend.head_dim  # K (or V) of one call
            copies = max(2, min(MAX_CALLS, 3 * llc // (2 * 2 * half * elem),
                                MAX_POOL // (2 * half * elem)))
            pool = torch.empty(copies * 2 * half, dtype=t).uniform_(-1.0, 1.0)
            shape = (context, batch, attend.kv_heads, attend.head_dim)
            views = [(pool[(2 * i) * half:(2 * i + 1) * half].view(shape),
                      pool[(2 * i + 1) * half:(2 * i + 2) * half].view(shape)) for i in range(copies)]
            q = torch.randn(1, batch, attend.heads, attend.head_dim).to(t)
            passes = []
            with standalone_core(attend, t) as core:
                for k, v in views[-2:]:
                    core(q, k, v)  # warm-up on the pass's last views: its first are the least recent
                for _ in range(ROUNDS):
                    start = time.perf_counter()
                    for k, v in views:
                        core(q, k, v)
                    passes.append((time.perf_counter() - start) / len(views))
            out.setdefault(attend, []).append([float(batch), float(context), statistics.median(passes)])
            del pool, views
    return out


def measure_memory() -> float:
    src = torch.empty(1 << 24, dtype=torch.float32).fill_(1.0)  # 64 MiB, past the caches
    dst = torch.empty_like(src)
    seconds = _best(lambda: dst.copy_(src), 5)
    return 2.0 * src.numel() * src.element_size() / seconds  # read and write


def _collective_member(name: str, member: int, queue: Any) -> None:
    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[member % len(cpus)]})  # a core each, as a job's local ranks run
    group = ShmCollectives(name, member, 2, create=member == 0, timeout_s=30.0)
    flush, ready = CacheFlush(), torch.zeros(1)
    try:
        out = {}
        for kind in ("all_reduce", "all_gather"):
            times = []
            for n in (SMALL, LARGE):
                x = torch.ones(n)
                gathered = torch.empty(2 * n)
                op = (lambda: group.all_reduce(x)) if kind == "all_reduce" else (lambda: group.all_gather(gathered, x))
                times.append(cold_median(op, lambda: group.all_reduce(ready), flush, COLD_CALLS))
            out[kind] = times
        queue.put((member, out))
    finally:
        group.close()
        if member == 0:
            group.unlink()


def measure_collectives() -> dict[str, list[float]]:
    """[latency s, bytes/s] per kind between two forked local processes; raises RuntimeError
    when the machine cannot run the shared-memory transport."""

    if not shm.supported():
        raise RuntimeError("this machine has no shared-memory transport to calibrate; use a fixed --layout")
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    name = shm.new_segment_name()
    procs = [ctx.Process(target=_collective_member, args=(name, m, queue)) for m in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
    slowest = {kind: tuple(max(a, b) for a, b in zip(results[0][kind], results[1][kind])) for kind in results[0]}
    return {kind: line_through(kind, (SMALL, LARGE), seconds, 2) for kind, seconds in slowest.items()}


def calibrate(key: TableKey, *, collectives: bool) -> CostTable:
    """A fresh table for ``key`` (a few seconds; the collectives fork two processes)."""
    torch.set_num_threads(key.threads)
    with torch.no_grad():
        gemm = {name: measure_gemm(getattr(torch, name)) for name in GEMM_DTYPES}
        memory = measure_memory()
    return CostTable(key, gemm, memory, measure_collectives() if collectives else {})
