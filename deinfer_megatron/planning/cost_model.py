"""A machine's measured costs — GEMM rate by shape, memory bandwidth, collective latency and
bandwidth — and the time they predict for one block of a layout.

``--layout auto`` needs to know, on *this* machine, whether the bytes a replicated factor adds
cost more than the collective it saves. The planner already says what each block holds and
sends (``Cost``: parameters per rank, collectives per token); a ``CostTable`` turns those counts
into seconds for a decode step of ``batch`` sequences at ``context`` cached tokens:

    t(block) = max(GEMM(batch tokens × the block's parameters on this rank),
                   the block's weight bytes / memory bandwidth)
             + KV bytes read by attention / memory bandwidth        (attention blocks)
             + Σ collectives (latency + batch · elements · dtype bytes / bandwidth)
             + the block's fixed framework time (per layout and block kind, at this TP size)

The last term is what a small model's step is made of: Python, Megatron's module glue and each
collective call's own Python, measured by ``planning.overhead`` at the TP size asked for, with the
fixed time per layer (norms, residuals) and outside the layers (embedding, final norm, output
layer, sampling, the loop) that complete a whole decode step (``planning.auto.outside_seconds``).

The table is calibrated once per host (``planning.calibrate``) and cached as JSON under the
cache dir, keyed by host id, project version, table format, torch version and thread count: a
cached table whose key differs from the running process's (another host, an older version, other
threads) is ignored and measured again, never trusted. Tests inject a table.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT = 2  # 2: framework overhead per TP size. Bump when the table's fields or their meaning change: older caches are ignored
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

    @classmethod
    def current(cls, threads: int | None = None) -> "TableKey":
        import torch

        return cls(host_id(), project_version(), torch.__version__,
                   threads if threads is not None else torch.get_num_threads())


@dataclass(frozen=True)
class CostTable:
    """Measured rates of one host.

    Attributes:
        key: what the measurement is valid for.
        gemm: dtype name → rows ``[m, weight elements, flop/s]`` of ``x[m, n] @ W[n, n]``.
        memory_bytes_per_s: streaming read bandwidth of one process.
        collectives: kind (``all_reduce``, ``all_gather``) → ``[latency s, bytes/s]`` between the
            ranks of one node (the job's shared-memory transport).
        overhead: TP size (as a string) → fixed seconds per decode step that no rate prices:
            ``{"blocks": {layout: {"attention": s, "mlp": s}}, "layer": s, "outside": s}`` — per
            block call by layout, per layer beside its blocks, and once per step outside the
            layers (``planning.overhead``). A TP size without an entry is priced at zero.
    """

    key: TableKey
    gemm: dict[str, list[list[float]]]
    memory_bytes_per_s: float
    collectives: dict[str, list[float]] = field(default_factory=dict)
    overhead: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "CostTable":
        return cls(TableKey(**doc["key"]), {k: [list(map(float, r)) for r in v] for k, v in doc["gemm"].items()},
                   float(doc["memory_bytes_per_s"]),
                   {k: [float(v[0]), float(v[1])] for k, v in doc.get("collectives", {}).items()},
                   {tp: _overhead_from_json(o) for tp, o in doc.get("overhead", {}).items()})

    # ------------------------------------------------------------------ predictions

    def gemm_seconds(self, dtype: str, m: int, elements: int) -> float:
        """Time of ``m`` tokens through ``elements`` weights, at the measured rate of the
        nearest shapes (linear in log m and log elements between grid points, clamped)."""
        if elements <= 0 or m <= 0:
            return 0.0
        rows = self.gemm.get(dtype) or self.gemm["float32"]
        rate = _interpolate(rows, math.log(m), math.log(elements))
        return 2.0 * m * elements / rate

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
    """Where this host's table lives: ``<cache dir>/cost_model/<host>-t<threads>.json``."""
    from deinfer_megatron.checkpoints.embedded import cache_dir

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key.host)
    return (root if root is not None else cache_dir() / "cost_model") / f"{safe}-t{key.threads}.json"


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
    """Write ``table`` to ``path`` whole (a temporary file renamed into place)."""
    from deinfer_megatron.files.staging import temp_name

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    tmp.write_text(json.dumps(table.to_json(), indent=1))
    os.replace(tmp, path)


def host_table(*, tp: int, threads: int | None = None, root: Path | None = None) -> CostTable:
    """This host's table: the cached one if its key matches, else a fresh calibration (seconds),
    cached for the next job. ``tp`` > 1 needs the collectives measured too, and every TP size its
    framework overhead (``planning.overhead``, measured once per TP size on ``tp`` local ranks)."""
    from dataclasses import replace

    from deinfer_megatron.planning.calibrate import calibrate

    key = TableKey.current(threads)
    path = cache_path(key, root)
    table = load_cached(path, key)
    if table is not None and (tp == 1 or table.collectives) and str(tp) in table.overhead:
        return table
    if table is None or (tp > 1 and not table.collectives):
        table = calibrate(key, collectives=tp > 1)
    if str(tp) not in table.overhead:
        from deinfer_megatron.planning.overhead import measure_overhead

        table = replace(table, overhead={**table.overhead, str(tp): measure_overhead(table, tp)})
    save(table, path)
    log.info("cost table measured and cached in %s", path)
    return table
