"""A machine's measured costs — GEMM rate by shape, memory bandwidth, collective latency and
bandwidth — and the time they predict for one block of a layout.

``--layout auto`` needs to know, on *this* machine, whether the bytes a replicated factor adds
cost more than the collective it saves. The planner already says what each block holds and
sends (``Cost``: parameters per rank, collectives per token); a ``CostTable`` turns those counts
into seconds for a decode step of ``batch`` sequences at ``context`` cached tokens:

    t(block) = Σ over the block's matrix products on this rank (``Cost.gemms``: k × n at its
                 shard's shape) of their measured time at batch rows, weights read from memory
             + the attention over the cached tokens, timed per core, heads, batch and context
               (``Cost.attends``; ``calibrate.measure_attention``)       (attention blocks)
             + Σ collectives (latency + batch · elements · dtype bytes / bandwidth)
             + the block's fixed framework time (per layout and block kind, at this TP size)

The last term is what a small model's step is made of: Python, Megatron's module glue and each
collective call's own Python, measured by ``planning.overhead`` at the TP size asked for, with the
fixed time per layer (norms, residuals) and outside the layers (embedding, final norm, output
layer, sampling, the loop) that complete a whole decode step (``planning.pricing.outside_seconds``).

The table is calibrated once per host (``planning.calibrate``) and cached as JSON under the
cache dir, keyed by host id, project version, table format, torch version and thread count: a
cached table whose key differs from the running process's (another host, an older version, other
threads) is ignored and measured again, never trusted. Tests inject a table.

The matrix products are timed per shape (``shapes``), lazily: a plan asks for the shapes and
batch rows it will price (``planning.pricing.required_gemms``), ``planning.host.host_table``
measures the missing ones (``calibrate.measure_shapes``) and adds them to the cache. Per shape,
because a CPU GEMM of weights read from memory turns compute-bound as the batch grows, which one
rate for square matrices does not see. A shape the table lacks (an injected table) falls back
to the square grid: max(FLOPs / grid rate, weight bytes / memory bandwidth).

The attention over a long cache is timed the same way, per (core, heads) at the job's batch and
context (``attention``), because its price is not its bytes: Megatron's unfused core copies K/V
once per query head, the project's does not (docs/INFERENCE.md has both timings). Without a
timing (an injected table, the latent cache's rebuilt K/V) the attention is priced as its K/V
bytes streamed from memory.
"""

from __future__ import annotations

import json
import logging
import math
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from deinfer_megatron.checkpoints.embedded import cache_dir
from deinfer_megatron.files.staging import write_atomic
from deinfer_megatron.launch import allocator
from deinfer_megatron.launch.allocator import DEFAULT_STATE
from deinfer_megatron.layers.costs import Attend, Gemm

log = logging.getLogger(__name__)

FORMAT = 7  # 2: framework overhead per TP size; 3: matrix products timed per shape; 4: collectives and fixed times with cold caches; 5: attention timed per context (and left out of the fixed times); 6: fixed times with the ranks lined up before each block, rounds interleaved; products and attention the median of their passes, not the fastest; 7: fixed times from models whose heads every TP size divides (dense measured above TP 4). Bump when the table's fields or their meaning change: older caches are ignored
GEMM_DTYPES = ("float32", "bfloat16")

def host_id() -> str:
    """This machine: its hostname and ``/etc/machine-id`` (a copied home directory on another
    host with the same name still differs by machine id)."""
    machine = ""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            machine = Path(path).read_text().strip()
            break
        except OSError:
            continue
    return f"{socket.gethostname()}/{machine}" if machine else socket.gethostname()


def project_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("deinfer-megatron")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class TableKey:
    """What a calibration is valid for; a cache with any other key is measured again."""

    host: str
    version: str
    torch: str
    threads: int
    format: int = FORMAT
    allocator: str = ""  # ``launch.allocator.state()``: one pass over a large temporary costs 7× more when mapped afresh

    @classmethod
    def current(cls, threads: int | None = None) -> "TableKey":
        import torch

        return cls(host_id(), project_version(), torch.__version__,
                   threads if threads is not None else torch.get_num_threads(), allocator=allocator.state())


@dataclass(frozen=True)
class CostTable:
    """Measured rates of one host.

    Attributes:
        key: what the measurement is valid for.
        gemm: dtype name → rows ``[m, weight elements, flop/s]`` of ``x[m, n] @ W[n, n]``
            (cached weights): the price of a matrix product only where ``shapes`` lacks it.
        memory_bytes_per_s: streaming read bandwidth of one process.
        collectives: kind (``all_reduce``, ``all_gather``) → ``[latency s, bytes/s]`` between the
            ranks of one node (the job's shared-memory transport).
        overhead: TP size (as a string) → fixed seconds per decode step that no rate prices:
            ``{"blocks": {layout: {"attention": s, "mlp": s}}, "layer": s, "outside": s}`` — per
            block call by layout, per layer beside its blocks, and once per step outside the
            layers (``planning.overhead``). A TP size without an entry is priced at zero.
        shapes: ``shape_key(dtype, gemm)`` → rows ``[batch rows, seconds]`` (ascending rows) of
            that matrix product with its weights read from memory (``calibrate.measure_shapes``).
        attention: ``attention_key(dtype, attend)`` → rows ``[batch, context, seconds]`` of one
            decode token's attention per sequence over ``context`` cached tokens, K/V read from
            memory (``calibrate.measure_attention``; batch as ``attention_batch`` caps it).
    """

    key: TableKey
    gemm: dict[str, list[list[float]]]
    memory_bytes_per_s: float
    collectives: dict[str, list[float]] = field(default_factory=dict)
    overhead: dict[str, dict[str, Any]] = field(default_factory=dict)
    shapes: dict[str, list[list[float]]] = field(default_factory=dict)
    attention: dict[str, list[list[float]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "CostTable":
        return cls(TableKey(**doc["key"]), {k: [list(map(float, r)) for r in v] for k, v in doc["gemm"].items()},
                   float(doc["memory_bytes_per_s"]),
                   {k: [float(v[0]), float(v[1])] for k, v in doc.get("collectives", {}).items()},
                   {tp: _overhead_from_json(o) for tp, o in doc.get("overhead", {}).items()},
                   {k: sorted([float(m), float(t)] for m, t in v) for k, v in doc.get("shapes", {}).items()},
                   {k: sorted([float(b), float(c), float(t)] for b, c, t in v)
                    for k, v in doc.get("attention", {}).items()})

    # ------------------------------------------------------------------ predictions

    def gemm_seconds(self, dtype: str, m: int, elements: int) -> float:
        """Time of ``m`` tokens through ``elements`` weights, at the measured rate of the
        nearest shapes (linear in log m and log elements between grid points, clamped)."""
        if elements <= 0 or m <= 0:
            return 0.0
        rows = self.gemm.get(dtype) or self.gemm["float32"]
        rate = _interpolate(rows, math.log(m), math.log(elements))
        return 2.0 * m * elements / rate

    def matmul_seconds(self, dtype: str, rows: int, gemm: Gemm) -> float:
        """One product of ``rows`` input rows by ``gemm``'s weights: its measured time at this
        shape (``shape_seconds``), or — a shape never measured — the square grid's rate at its
        weight count, or the weights streamed from memory when that is slower."""
        if rows <= 0 or gemm.weights <= 0:
            return 0.0
        measured = self.shapes.get(shape_key(dtype, gemm))
        if measured:
            return shape_seconds(measured, rows)
        nbytes = gemm.weights * dtype_bytes(dtype)
        return max(self.gemm_seconds(dtype, rows, gemm.weights), self.memory_seconds(nbytes))

    def missing_shapes(self, dtype: str, needs: Iterable[tuple[Gemm, int]]) -> set[tuple[Gemm, int]]:
        """The (shape, rows) of ``needs`` this table has not measured."""
        have = {(k, int(m)) for k, rows in self.shapes.items() for m, _ in rows}
        return {(g, m) for g, m in needs if (shape_key(dtype, g), m) not in have}

    def attention_seconds(self, dtype: str, attend: Attend, batch: int, context: int) -> float:
        """One decode step's ``attend`` for ``batch`` sequences over ``context`` cached tokens:
        its timing at (``attention_batch``, ``context``), scaled by the batch (each sequence reads
        its own K/V); untimed, the K/V bytes streamed from memory."""
        if batch <= 0 or context <= 0:
            return 0.0
        timed = attention_batch(dtype, attend, batch, context)
        for b, c, seconds in self.attention.get(attention_key(dtype, attend), ()):
            if (int(b), int(c)) == (timed, context):
                return seconds * batch / timed
        return self.memory_seconds(batch * context * 2 * attend.kv_heads * attend.head_dim * dtype_bytes(dtype))

    def missing_attention(self, dtype: str, needs: Iterable[tuple[Attend, int, int]]) -> set[tuple[Attend, int, int]]:
        """The (attend, timed batch, context) of ``needs`` (each as ``attention_batch`` times it)
        this table has not measured."""
        have = {(k, int(b), int(c)) for k, rows in self.attention.items() for b, c, _ in rows}
        return {(a, b, c) for a, b, c in attention_cases(dtype, needs) if (attention_key(dtype, a), b, c) not in have}

    def memory_seconds(self, nbytes: float) -> float:
        return nbytes / self.memory_bytes_per_s if nbytes > 0 else 0.0

    def block_overhead(self, tp: int, layout: str, block: str) -> float:
        """Fixed seconds of one ``block`` (``attention``/``mlp``) call in ``layout`` at TP ``tp``."""
        return float(self.overhead.get(str(tp), {}).get("blocks", {}).get(layout, {}).get(block, 0.0))

    def layer_overhead(self, tp: int) -> float:
        """Fixed seconds per transformer layer beside its two blocks (norms, residual adds)."""
        return float(self.overhead.get(str(tp), {}).get("layer", 0.0))

    def outside_overhead(self, tp: int) -> float:
        """Fixed seconds per step outside the layers (embedding, final norm, output, sampling)."""
        return float(self.overhead.get(str(tp), {}).get("outside", 0.0))

    def collective_seconds(self, kind: str, nbytes: float) -> float:
        """One collective of ``nbytes`` (the gathered or reduced tensor); a reduce-scatter costs
        what an all-reduce does."""
        latency, bandwidth = self.collectives.get(kind) or self.collectives["all_reduce"]
        return latency + nbytes / bandwidth


def shape_key(dtype: str, gemm: Gemm) -> str:
    """``float32:2048x717x1`` (``T`` appended for a weight stored ``(n, k)``)."""
    return f"{dtype}:{gemm.k}x{gemm.n}x{gemm.count}{'T' if gemm.transposed else ''}"


def attention_key(dtype: str, attend: Attend) -> str:
    """``float32:sdpa:16/4x64`` (core, query heads / KV heads × head dim; ``+rope`` appended
    where the block rotates every cached key first, ``Attend.rotary``)."""
    rope = "+rope" if attend.rotary else ""
    return f"{dtype}:{attend.core}{rope}:{attend.heads}/{attend.kv_heads}x{attend.head_dim}"


ATTENTION_COPY_BYTES = 128 << 20  # K/V of one timed attention call at most; larger batches are scaled


def dtype_bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


def attention_batch(dtype: str, attend: Attend, batch: int, context: int) -> int:
    """The batch at which ``attend`` is timed for ``batch`` sequences at ``context``: the job's
    own, or fewer where their K/V would exceed ``ATTENTION_COPY_BYTES`` (an eval-ppl window
    priced as a decode step of batch × window rows) — the time is then scaled by the batch."""
    per_sequence = 2 * context * attend.kv_heads * attend.head_dim * dtype_bytes(dtype)
    return max(1, min(batch, ATTENTION_COPY_BYTES // max(1, per_sequence)))


def attention_cases(dtype: str, needs: Iterable[tuple[Attend, int, int]]) -> set[tuple[Attend, int, int]]:
    """The (attend, batch, context) timings that price ``needs`` (``attention_batch``)."""
    return {(a, attention_batch(dtype, a, b, c), c) for a, b, c in needs}


def shape_seconds(rows: list[list[float]], m: float) -> float:
    """The time at ``m`` batch rows from measured ``[rows, seconds]`` (ascending rows):
    piecewise linear in rows between measurements, never decreasing with rows (each time is
    taken as at least every smaller batch's: a noisy run cannot make more rows cheaper), the
    smallest measurement below the grid and the last segment's slope beyond it (proportional
    to rows from a single measurement)."""
    ms = [r[0] for r in rows]
    ts: list[float] = []
    for _, t in rows:
        ts.append(max(t, ts[-1]) if ts else t)
    if m <= ms[0]:
        return ts[0]
    if m >= ms[-1]:
        if len(ms) == 1:
            return ts[0] * m / ms[0]
        slope = (ts[-1] - ts[-2]) / (ms[-1] - ms[-2])
        return ts[-1] + slope * (m - ms[-1])
    for i in range(len(ms) - 1):
        if ms[i] <= m <= ms[i + 1]:
            f = (m - ms[i]) / (ms[i + 1] - ms[i])
            return ts[i] * (1 - f) + ts[i + 1] * f
    raise AssertionError("unreachable: m lies inside the grid")


def _overhead_from_json(doc: dict[str, Any]) -> dict[str, Any]:
    blocks = {layout: {b: float(v) for b, v in per.items()} for layout, per in doc["blocks"].items()}
    return {"blocks": blocks, "layer": float(doc["layer"]), "outside": float(doc["outside"])}


def _interpolate(rows: list[list[float]], lm: float, le: float) -> float:
    """Bilinear interpolation of the rate over (log m, log elements) on the measured grid."""
    ms = sorted({r[0] for r in rows})
    es = sorted({r[1] for r in rows})
    rate = {(r[0], r[1]): r[2] for r in rows}

    def bracket(values: list[float], x: float) -> tuple[float, float, float]:
        logs = [math.log(v) for v in values]
        if x <= logs[0]:
            return values[0], values[0], 0.0
        if x >= logs[-1]:
            return values[-1], values[-1], 0.0
        for i in range(len(values) - 1):
            if logs[i] <= x <= logs[i + 1]:
                return values[i], values[i + 1], (x - logs[i]) / (logs[i + 1] - logs[i])
        raise AssertionError("unreachable: x lies inside the grid")

    m0, m1, fm = bracket(ms, lm)
    e0, e1, fe = bracket(es, le)
    low = rate[(m0, e0)] * (1 - fe) + rate[(m0, e1)] * fe
    high = rate[(m1, e0)] * (1 - fe) + rate[(m1, e1)] * fe
    return low * (1 - fm) + high * fm


# ---------------------------------------------------------------------- the per-host cache


def cache_path(key: TableKey, root: Path | None = None) -> Path:
    """Where this host's table lives: ``<cache dir>/cost_model/<host>-t<threads>.json``, with
    ``-<allocator>`` before ``.json`` when the allocator state is not the project's default, so
    that a job run with ``DEINFER_MEGATRON_MALLOC=system`` (or a preloaded allocator) keeps its
    own table instead of re-measuring over the default's at every switch."""

    def slug(text: str) -> str:
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)

    name = f"{slug(key.host)}-t{key.threads}"
    if key.allocator and key.allocator != DEFAULT_STATE:
        name += "-" + slug(key.allocator)[:80]
    return (root if root is not None else cache_dir() / "cost_model") / f"{name}.json"


def load_cached(path: Path, key: TableKey) -> CostTable | None:
    """The table at ``path`` if it was measured for ``key``; None (and a log line saying why)
    for a missing, unreadable, foreign or stale one."""
    try:
        table = CostTable.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        log.info("cost table %s is unreadable (%s); measuring again", path, err)
        return None
    if table.key != key:
        log.info("cost table %s was measured for %s, not %s; measuring again", path, table.key, key)
        return None
    return table


def save(table: CostTable, path: Path) -> None:
    """Write ``table`` to ``path`` whole (``files.staging.write_atomic``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(table.to_json(), indent=1))
