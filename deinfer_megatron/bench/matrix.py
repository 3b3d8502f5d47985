"""The bench's configuration grid and the parent side of running one cell.

A cell is (layout, KV cache, TP, batch, prompt length), a job of the runtime (``runtime.job``;
``measure.CellJob``): every cell is prepared first — its checks, its one plan (``auto`` priced
for the cell's batch and context), its memory check — and then runs in fresh ranks (~5 s of
start-up each) so that no cell inherits another's caches, allocator state or warmed-up pages. A
cell that cannot apply (latent cache off the deinfer layout, a factored layout on a dense
folder, dense attention with more ranks than KV heads, more memory than the machine has) is
recorded as skipped with the reason; a cell that fails is recorded with its one-line error and
the matrix goes on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from deinfer_megatron.bench.measure import CellJob, check_lengths, measure_cell
from deinfer_megatron.bench.records import Cell, CellRecord, CellStatus, Peer, PlanTotals, RankMeasurement, first_line
from deinfer_megatron.bench.sources import ModelSource
from deinfer_megatron.decompose.allocation import check_ratio
from deinfer_megatron.generation.prefill import DEFAULT_MAX_PREFILL_TOKENS, check_max_tokens
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.models.synthetic import synthetic_config
from deinfer_megatron.parallel.collectives import Collectives
from deinfer_megatron.parallel.topology import check_parallel_sizes
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.planning.request import LayoutRequest, choices
from deinfer_megatron.runtime.job import Prepared, prepare, run_prepared
from deinfer_megatron.runtime.options import DType, Parallelism

LAYOUTS: tuple[LayoutRequest, ...] = tuple(LayoutRequest.parse(name) for name in choices())  # auto first
KV_CACHES: tuple[CacheKind, ...] = tuple(CacheKind)


@dataclass(frozen=True)
class BenchGrid:
    """The experiment: which model, which cells, how many runs each (checked by ``check_config``)."""

    model: Path | None = None
    synthetic: str | None = None
    ratio: float = 0.6
    layouts: tuple[LayoutRequest, ...] = LAYOUTS  # names and layouts are parsed
    kv_caches: tuple[CacheKind, ...] = (CacheKind.FULL,)
    tps: tuple[int, ...] = (1, 2)
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_lens: tuple[int, ...] = (128,)
    gen_len: int = 32
    repeats: int = 3
    seed: int = 0
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS  # rows per prefill forward (generation.prefill)
    roofline: bool = False  # also measure this machine's rates and bound each decode step
    profile: bool = False  # split one decode step per rank into GEMM / waiting / collectives / rest
    predict: bool = False  # the cost model's step beside every cell's (always for auto cells)
    cell_timeout_s: float = 1800.0
    peers: tuple[Peer, ...] = ()  # other implementations beside the cells (``bench.peers``)
    # collective rates ({kind: [latency s, bytes/s]}, ``CostTable.collectives``) measured on the
    # link the cells' ranks use, priced by ``auto`` and ``--predict`` in place of the host table's
    # local ones: set by a runner whose ranks do not share memory (the two-namespace bench)
    collectives: dict[str, list[float]] | None = None
    transport: Collectives = Collectives.AUTO  # what carries the cells' TP collectives (parallel.collectives)
    dtype: DType = DType.FLOAT32  # every cell's and peer's weights, factors and KV caches

    def __post_init__(self) -> None:
        object.__setattr__(self, "layouts", tuple(LayoutRequest.parse(l) for l in self.layouts))
        object.__setattr__(self, "transport", Collectives.parse(self.transport))
        object.__setattr__(self, "dtype", DType.parse(self.dtype))


@dataclass(frozen=True)
class BenchOutputs:
    """Where the results go, and whether a progress bar is drawn on stderr."""

    json: Path | None = None
    markdown: Path | None = None
    plot: Path | None = None
    progress: bool = True


@dataclass(frozen=True)
class BenchConfig:
    """Everything ``deinfer-megatron bench`` was asked for."""

    grid: BenchGrid
    outputs: BenchOutputs = field(default_factory=BenchOutputs)

    def to_json(self) -> dict[str, Any]:
        """The document's ``args``: every option, by its name in earlier documents (``peers``,
        and ``dtype`` other than float32, only when asked for, so that a run without them has
        the earlier documents' keys)."""
        g, o = self.grid, self.outputs
        path = lambda p: None if p is None else str(p)  # noqa: E731
        args = {"model": path(g.model), "synthetic": g.synthetic, "ratio": g.ratio,
                "layouts": [l.name for l in g.layouts], "kv_caches": [k.value for k in g.kv_caches],
                "tps": list(g.tps), "batches": list(g.batches), "prompt_lens": list(g.prompt_lens),
                "gen_len": g.gen_len, "repeats": g.repeats, "seed": g.seed, "json": path(o.json),
                "markdown": path(o.markdown), "plot": path(o.plot), "roofline": g.roofline,
                "cell_timeout_s": g.cell_timeout_s, "progress": o.progress,
                # newer options appear only when asked for: earlier documents keep their keys
                **({"profile": True} if g.profile else {}), **({"predict": True} if g.predict else {}),
                **({"max_prefill_tokens": g.max_prefill_tokens}
                   if g.max_prefill_tokens != DEFAULT_MAX_PREFILL_TOKENS else {}),
                **({"dtype": g.dtype.value} if g.dtype is not DType.FLOAT32 else {})}
        return {**args, "peers": [p.value for p in g.peers]} if g.peers else args


def check_config(cfg: BenchConfig) -> None:
    """Everything that can be rejected before a model is drawn or a rank started."""
    grid = cfg.grid
    if (grid.model is None) == (grid.synthetic is None):
        raise ValueError("give exactly one of --model DIR or --synthetic NAME")
    if grid.synthetic is not None:

        synthetic_config(grid.synthetic)  # unknown name → names the choices
        check_ratio(grid.ratio)
    for flag, values, allowed in (("--layouts", grid.layouts, choices()),
                                  ("--kv-cache", grid.kv_caches, [k.value for k in KV_CACHES])):
        if not values:
            raise ValueError(f"{flag} needs at least one of {','.join(allowed)}")
    for flag, ints in (("--tp", grid.tps), ("--batch", grid.batches), ("--prompt-len", grid.prompt_lens)):
        if not ints:
            raise ValueError(f"{flag} needs at least one positive integer, e.g. {flag} 1,2")
        if min(ints) < 1:
            raise ValueError(f"{flag} values must be positive integers, got {min(ints)}")
    if grid.gen_len < 2:
        raise ValueError(f"--gen-len must be at least 2 (a decode step follows the first token), got {grid.gen_len}")
    if grid.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {grid.repeats}")
    check_max_tokens(grid.max_prefill_tokens)
    if cfg.outputs.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib; pip install matplotlib") from None


def check_sizes(grid: BenchGrid, source: ModelSource) -> None:
    """TP sizes and lengths this model cannot take (the same one-line errors as ``plan``),
    before any cell is prepared."""
    for tp in grid.tps:
        check_parallel_sizes(source.arch, tp, 1)
    check_lengths(source.arch, max(grid.prompt_lens), grid.gen_len)


def make_cells(grid: BenchGrid) -> list[Cell]:
    """The grid in a stable order: prompt length, TP, batch, then layout and KV cache."""
    return [Cell(layout, kv, tp, batch, ctx)
            for ctx in grid.prompt_lens for tp in grid.tps for batch in grid.batches
            for layout in grid.layouts for kv in grid.kv_caches]


def random_prompts(vocab: int, batch: int, prompt_len: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """Random token ids, exactly ``prompt_len`` per row; the same for every layout of a cell."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch * 1_009 + prompt_len)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=gen)
    return tuple(tuple(row) for row in ids.tolist())


def cell_job(cell: Cell, source: ModelSource, grid: BenchGrid) -> CellJob:
    """What the cell's ranks run (its folder: the source's, replaced by the multiplied-out one
    when the plan is dense throughout: ``prepare_cell``)."""
    return CellJob(source.folder, Parallelism(cell.tp, 1, cell.layout, grid.transport), cell.kv_cache,
                   cell.batch, cell.prompt_len, grid.gen_len, grid.repeats,
                   random_prompts(source.arch.vocab_size, cell.batch, cell.prompt_len, grid.seed),
                   profile=grid.profile, max_prefill_tokens=grid.max_prefill_tokens, dtype=grid.dtype)


def prepare_cell(cell: Cell, source: ModelSource, grid: BenchGrid) -> Prepared:
    """The cell as a prepared job of the runtime: its checks and its one plan, ``auto`` priced
    for the cell's TP, batch, context and KV cache on this host (with ``grid.collectives`` in
    place of the host table's rates); ValueError when the cell cannot run."""
    reason = source.skip_reason(cell.layout, cell.kv_cache)
    if reason is not None:
        raise ValueError(reason)
    prepared = prepare(cell_job(cell, source, grid), opened=(source.arch, source.rank_config),
                       collectives=grid.collectives)
    assert prepared.plan is not None, "bench cells run in ranks of their own, never under a launcher"
    return replace(prepared, spec=replace(prepared.spec, model=source.folder_for(prepared.plan)))


def plan_totals(prepared: Prepared) -> PlanTotals:
    """The planner's per-token totals for a prepared cell's plan (KV bytes in the cell's dtype)."""
    spec = prepared.spec
    plan = make_plan(prepared.arch, prepared.rank_config, prepared.plan, tp=spec.tp, batch=spec.batch,
                     dtype_bytes=spec.dtype.itemsize)
    t = plan.totals
    return PlanTotals(t["collectives_per_token"], t["elements_per_token"], t["params_per_rank"],
                      t["kv_bytes_per_token"][spec.kv_cache.value],
                      tuple(tuple(op) for layer in plan.layers for op in layer.collective_ops))


def run_cell(prepared: Prepared, grid: BenchGrid) -> list[RankMeasurement]:
    """Run a prepared cell in fresh local ranks; every rank's measurements, by rank."""
    return run_prepared(prepared, measure_cell, timeout=grid.cell_timeout_s)


Runner = Callable[[Prepared, BenchGrid], list[RankMeasurement]]
PreparedCell = tuple[Cell, "Prepared | str"]  # a cell and its prepared job, or why it does not apply


def prepare_cells(grid: BenchGrid, source: ModelSource) -> list[PreparedCell]:
    """Every cell of the grid with its prepared job, or the reason it does not apply; one line
    naming why when none applies."""
    out: list[PreparedCell] = []
    for cell in make_cells(grid):
        try:
            out.append((cell, prepare_cell(cell, source, grid)))
        except ValueError as err:  # e.g. dense attention with more ranks than KV heads
            out.append((cell, str(err).splitlines()[0]))
    if all(isinstance(p, str) for _, p in out):
        raise ValueError("no configuration can run: " + "; ".join(dict.fromkeys(p for _, p in out)))
    return out


def run_matrix(grid: BenchGrid, cells: list[PreparedCell], runner: Runner = run_cell, *,
               progress: bool = True) -> list[CellRecord]:
    """Every cell's record: measured (with per-rank results), skipped or failed."""
    from tqdm import tqdm

    records = []
    bar = tqdm(cells, desc="bench", unit="cell", disable=not progress, dynamic_ncols=True)
    for cell, prepared in bar:
        bar.set_postfix_str(cell.label())
        head = dict(cell=cell, gen_len=grid.gen_len, repeats=grid.repeats)
        if isinstance(prepared, str):
            records.append(CellRecord(**head, status=CellStatus.SKIPPED, reason=prepared))
            continue
        plan = plan_totals(prepared)
        start = time.perf_counter()
        try:
            ranks = runner(prepared, grid)
        except Exception as err:  # noqa: BLE001 - a failed cell is data; the matrix goes on
            records.append(CellRecord(**head, status=CellStatus.ERROR, plan=plan, error=first_line(err),
                                      wall_s=time.perf_counter() - start))
            continue
        records.append(CellRecord(**head, status=CellStatus.OK, plan=plan, wall_s=time.perf_counter() - start,
                                  ranks=tuple(ranks)))
    bar.close()
    return records
