"""Measure a ``CostTable`` on this machine in a few seconds: a small GEMM grid (fp32, bf16), a
streaming copy for memory bandwidth, and all-reduce / all-gather between two forked processes
over the shared-memory transport the job's local ranks use (``parallel.shm``).

Each figure is the best of a few repetitions, because a shared machine only ever adds time: the
fastest run is the closest to what the hardware does. Latency and bandwidth of a collective are
the line through its time at a small and a large message.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any, Callable

import torch

from deinfer_megatron.planning.cost_model import GEMM_DTYPES, CostTable, TableKey

GEMM_TOKENS = (1, 8, 64, 256)
GEMM_SIDES = (256, 1024, 2048)  # weights n × n
SMALL, LARGE = 64, 1 << 18  # collective message sizes in float32 elements


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


def measure_memory() -> float:
    src = torch.empty(1 << 24, dtype=torch.float32).fill_(1.0)  # 64 MiB, past the caches
    dst = torch.empty_like(src)
    seconds = _best(lambda: dst.copy_(src), 5)
    return 2.0 * src.numel() * src.element_size() / seconds  # read and write


def _collective_member(name: str, member: int, queue: Any) -> None:
    from deinfer_megatron.parallel.shm import ShmCollectives

    torch.set_num_threads(1)
    group = ShmCollectives(name, member, 2, create=member == 0, timeout_s=30.0)
    try:
        out = {}
        for kind in ("all_reduce", "all_gather"):
            times = []
            for n in (SMALL, LARGE):
                x = torch.ones(n)
                gathered = torch.empty(2 * n)
                op = (lambda: group.all_reduce(x)) if kind == "all_reduce" else (lambda: group.all_gather(gathered, x))
                times.append(_best(op, 20, budget_s=0.5))
            out[kind] = times
        queue.put((member, out))
    finally:
        group.close()
        if member == 0:
            group.unlink()


def measure_collectives() -> dict[str, list[float]]:
    """[latency s, bytes/s] per kind between two forked local processes; raises RuntimeError
    when the machine cannot run the shared-memory transport."""
    from deinfer_megatron.parallel import shm

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
    out = {}
    for kind in ("all_reduce", "all_gather"):
        small, large = (max(a, b) for a, b in zip(results[0][kind], results[1][kind]))
        nbytes = 4 * (LARGE - SMALL) * (2 if kind == "all_gather" else 1)
        bandwidth = nbytes / max(large - small, 1e-9)
        out[kind] = [max(small - 4 * SMALL / bandwidth, 1e-7), bandwidth]
    return out


def calibrate(key: TableKey, *, collectives: bool) -> CostTable:
    """A fresh table for ``key`` (a few seconds; the collectives fork two processes)."""
    torch.set_num_threads(key.threads)
    with torch.no_grad():
        gemm = {name: measure_gemm(getattr(torch, name)) for name in GEMM_DTYPES}
        memory = measure_memory()
    return CostTable(key, gemm, memory, measure_collectives() if collectives else {})
