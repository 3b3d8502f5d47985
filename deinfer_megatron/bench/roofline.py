"""This machine's rates, and a lower bound on one decode step built from them.

Three measurements, all on two spawned ranks so that the collectives are gloo's real ones:
- copy bandwidth: one large float32 ``copy_`` (single thread), counted as bytes read + written;
- GEMM rate: ``F.linear`` at decode shapes (batch × hidden by hidden × out), single thread, in
  the bench's dtype (``RooflineSizes.dtype``: bfloat16 products run other kernels);
- collective latency: all-reduce and all-gather of 1 .. 1M elements (4× steps) of that dtype, 2 ranks, through
  the same named operations the layers call (``parallel.comm``), copies and reshapes included —
  once through the transport the ranks install (shared memory between local ranks), which bounds
  the step, and once with the group routed back to gloo (``gloo_latency_s``; None when gloo is
  what was installed), so that every roofline shows what the transport saves per element count.

A decode step reads every weight a rank holds (except the embedding table, of which it reads
``batch`` rows; a tied table is read in full by the output layer) and the KV cache so far, and
waits for every collective in turn. So the bound is
``(weight bytes + KV bytes read) / copy bandwidth + Σ latency(collective size)`` with the
planner's collectives plus Megatron's two of the vocabulary layers at TP > 1 (embedding
all-reduce of h, logits all-gather of the vocabulary). Compute time at the measured GEMM rate is
reported beside it (``compute_s``), and ``bound_with_compute_s`` = max(memory, compute) + comm:
single-threaded CPU GEMMs can make a batch-8 step compute-bound, where the memory bound alone
is loose.
Latencies for TP > 2 reuse the 2-rank curve (a lower estimate on one host).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from deinfer_megatron.bench.records import CellRecord, StepBound
from deinfer_megatron.bench.transports import markdown
from deinfer_megatron.launch.local import spawn_local
from deinfer_megatron.parallel import comm
from deinfer_megatron.parallel.runtime import init_parallel, shutdown
from deinfer_megatron.parallel.topology import TPView

COMM_SIZES = tuple(4**k for k in range(11))  # 1 .. 1,048,576 elements


@dataclass(frozen=True)
class RooflineSizes:
    copy_bytes: int = 512 << 20
    gemm_shapes: tuple[tuple[int, int, int], ...] = ((8, 2048, 2048), (8, 2048, 5632))
    comm_sizes: tuple[int, ...] = COMM_SIZES
    iters: int = 10
    dtype: str = "float32"  # of the products and the collectives: the cells' (``bench --dtype``)


def sizes_for(arch: Any, batches: tuple[int, ...], dtype: str = "float32") -> RooflineSizes:
    h, i = arch.hidden_size, arch.ffn_hidden_size
    return RooflineSizes(gemm_shapes=tuple(s for b in batches for s in ((b, h, h), (b, h, i))), dtype=dtype)


def _best_of(fn: Any, iters: int) -> float:
    fn()  # warm-up (page faults, allocator)
    best = math.inf
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_gbps(nbytes: int, iters: int) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _best_of(lambda: dst.copy_(src), iters) / 1e9


def gemm_gflops(m: int, k: int, n: int, iters: int, dtype: torch.dtype = torch.float32) -> float:
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    return 2 * m * k * n / _best_of(lambda: torch.nn.functional.linear(x, w), iters) / 1e9


def _collective_s(kind: str, elements: int, tp: Any, iters: int, dtype: torch.dtype = torch.float32) -> float:
    """Seconds per collective through the project's own named operations (``parallel.comm``)."""
    if kind == "all_reduce":
        x = torch.ones(1, elements, dtype=dtype)
        op = lambda: comm.all_reduce_sum(x, tp, site="roofline", layer=0)  # noqa: E731
    else:  # the gathered result has ``elements`` elements, as the ledger counts it
        chunk = torch.ones(1, max(1, -(-elements // tp.size)), dtype=dtype)
        op = lambda: comm.all_gather_last_dim(chunk, tp, site="roofline", layer=0)  # noqa: E731
    for _ in range(2):
        op()
    best = math.inf
    for _ in range(3):
        comm.barrier(tp)
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def _latency_curves(tp: Any, sizes: RooflineSizes) -> dict[str, dict[str, float]]:
    dtype = getattr(torch, sizes.dtype)
    return {kind: {str(n): _collective_s(kind, n, tp, sizes.iters, dtype) for n in sizes.comm_sizes}
            for kind in ("all_reduce", "all_gather")}


def machine_worker(sizes: RooflineSizes) -> dict[str, Any] | None:
    """Runs on each of 2 ranks; rank 0 returns the measurements."""

    torch.set_num_threads(1)
    groups = init_parallel(2, 1)
    try:
        out: dict[str, Any] = {}
        if groups.tp_rank == 0:  # the peer waits in the barrier meanwhile
            out["copy_gbps"] = copy_gbps(sizes.copy_bytes, sizes.iters)
            dtype = getattr(torch, sizes.dtype)
            out["gemm"] = [{"m": m, "k": k, "n": n, "gflops": gemm_gflops(m, k, n, sizes.iters, dtype)}
                           for m, k, n in sizes.gemm_shapes]
        tp = TPView.of(groups.pg_collection.tp)
        comm.barrier(tp)
        out["comm_transport"] = groups.transport.kind
        out["comm_latency_s"] = _latency_curves(tp, sizes)
        installed, out["gloo_latency_s"] = comm.transport_of(tp.group), None
        if installed is not None:
            comm.use_transport(tp.group, None)
            try:
                out["gloo_latency_s"] = _latency_curves(tp, sizes)
            finally:
                comm.use_transport(tp.group, installed)
        out["comm_ranks"] = 2
    finally:
        shutdown()
    return out if groups.tp_rank == 0 else None


def measure_machine(sizes: RooflineSizes) -> dict[str, Any]:
    result = spawn_local(2, machine_worker, sizes)[0]
    result["copy_bytes"] = sizes.copy_bytes
    return result


def transport_table(machine: dict[str, Any]) -> str | None:
    """Markdown: µs per collective and element count, the installed transport against gloo
    (None when gloo itself was installed, or for a document written before gloo was measured)."""

    if not machine.get("gloo_latency_s"):
        return None
    return markdown({machine["comm_transport"]: machine["comm_latency_s"], "gloo": machine["gloo_latency_s"]})


def latency_s(curve: dict[str, float], elements: int) -> float:
    """Log-log interpolation of a measured latency curve; linear in size beyond its end.

    The curve is first made non-decreasing from the top (a size's latency is the least measured
    at that size or above): a larger collective is never faster, and on a busy host the
    smallest sizes are the noisiest, so this keeps the bound a lower one.
    """
    points = sorted((int(n), t) for n, t in curve.items())
    for i in range(len(points) - 2, -1, -1):
        points[i] = (points[i][0], min(points[i][1], points[i + 1][1]))
    if elements <= points[0][0]:
        return points[0][1]
    for (n0, t0), (n1, t1) in zip(points, points[1:]):
        if elements <= n1:
            f = math.log(elements / n0) / math.log(n1 / n0)
            return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
    n, t = points[-1]
    return t * elements / n


def step_bound(rec: CellRecord, arch: Any, machine: dict[str, Any], dtype_bytes: int = 4) -> StepBound:
    """The lower bound of one decode step of a measured (and summarised) cell whose weights are
    ``dtype_bytes`` each (its KV bytes come from its plan, counted in the same dtype)."""
    assert rec.plan is not None and rec.summary is not None, "bound a measured, summarised cell"
    plan, batch, tp = rec.plan, rec.cell.batch, rec.cell.tp
    h = arch.hidden_size
    vocab_rows = -(-arch.vocab_size // tp)
    read_params = plan.params_per_rank - (0 if arch.tied_embeddings else vocab_rows * h)
    weight_bytes = read_params * dtype_bytes
    mean_len = rec.cell.prompt_len + rec.gen_len / 2  # decode steps attend to prompt+1 .. prompt+gen-1
    kv_bytes = int(plan.kv_bytes_per_token * batch * mean_len)
    memory_s = (weight_bytes + kv_bytes) / (machine["copy_gbps"] * 1e9)
    ops = list(plan.collective_ops)
    if tp > 1:
        ops += [("all_reduce", h), ("all_gather", vocab_rows * tp)]
    comm_s = sum(latency_s(machine["comm_latency_s"][kind], n * batch) for kind, n in ops)
    rates = [g["gflops"] for g in machine["gemm"] if g["m"] == batch] or [max(g["gflops"] for g in machine["gemm"])]
    compute_s = 2 * read_params * batch / (max(rates) * 1e9)
    bound = memory_s + comm_s
    measured = rec.summary.tpot_s
    return StepBound(weight_bytes=weight_bytes, kv_bytes=kv_bytes, memory_s=memory_s, collectives=len(ops),
                     comm_s=comm_s, compute_s=compute_s, bound_s=bound,
                     bound_with_compute_s=max(memory_s, compute_s) + comm_s,
                     measured_s=measured, measured_over_bound=measured / bound if bound > 0 else None)
