"""The bench's configuration grid and the parent side of running one cell.

A cell is (layout, KV cache, TP, batch, prompt length). Each runs in fresh ranks (one
``spawn_local`` per cell, ~5 s of start-up each) so that no cell inherits another's caches,
allocator state or warmed-up pages. A cell that cannot apply (latent cache off the deinfer
layout, a factored layout on a dense folder, dense attention with more ranks than KV heads) is
recorded as skipped with the reason; a cell that fails is recorded with its one-line error and
the matrix goes on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from deinfer_megatron.bench.records import Cell, CellRecord, CellStatus, PlanTotals, RankMeasurement
from deinfer_megatron.bench.sources import ModelSource
from deinfer_megatron.generation.prefill import DEFAULT_MAX_PREFILL_TOKENS, check_max_tokens
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.specs.layout import AUTO, Layout, LayoutPlan

if TYPE_CHECKING:
    from deinfer_megatron.bench.peers import Peer

LAYOUTS: tuple[Layout | str, ...] = (AUTO, *Layout)  # auto: the cost model's plan per cell
KV_CACHES: tuple[CacheKind, ...] = tuple(CacheKind)


@dataclass(frozen=True)
class BenchGrid:
    """The experiment: which model, which cells, how many runs each (checked by ``check_config``)."""

    model: Path | None = None
    synthetic: str | None = None
    ratio: float = 0.6
    layouts: tuple[Layout | str, ...] = LAYOUTS
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
        """The document's ``args``: every option, by its name in earlier documents (``peers``
        only when asked for, so that a run without them has the earlier documents' keys)."""
        g, o = self.grid, self.outputs
        path = lambda p: None if p is None else str(p)  # noqa: E731
        args = {"model": path(g.model), "synthetic": g.synthetic, "ratio": g.ratio,
                "layouts": [getattr(l, "value", l) for l in g.layouts], "kv_caches": [k.value for k in g.kv_caches],
                "tps": list(g.tps), "batches": list(g.batches), "prompt_lens": list(g.prompt_lens),
                "gen_len": g.gen_len, "repeats": g.repeats, "seed": g.seed, "json": path(o.json),
                "markdown": path(o.markdown), "plot": path(o.plot), "roofline": g.roofline,
                "cell_timeout_s": g.cell_timeout_s, "progress": o.progress,
                # newer options appear only when asked for: earlier documents keep their keys
                **({"profile": True} if g.profile else {}), **({"predict": True} if g.predict else {}),
                **({"max_prefill_tokens": g.max_prefill_tokens}
                   if g.max_prefill_tokens != DEFAULT_MAX_PREFILL_TOKENS else {})}
        return {**args, "peers": [p.value for p in g.peers]} if g.peers else args


def check_config(cfg: BenchConfig) -> None:
    """Everything that can be rejected before a model is drawn or a rank started."""
    grid = cfg.grid
    if (grid.model is None) == (grid.synthetic is None):
        raise ValueError("give exactly one of --model DIR or --synthetic NAME")
    if grid.synthetic is not None:
        from deinfer_megatron.decompose.allocation import check_ratio
        from deinfer_megatron.models.synthetic import synthetic_config

        synthetic_config(grid.synthetic)  # unknown name → names the choices
        check_ratio(grid.ratio)
    for flag, values, allowed in (("--layouts", grid.layouts, LAYOUTS), ("--kv-cache", grid.kv_caches, KV_CACHES)):
        if not values:
            raise ValueError(f"{flag} needs at least one of {','.join(getattr(m, 'value', m) for m in allowed)}")
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
    """TP sizes and lengths this model cannot take (the same one-line errors as ``plan``)."""
    from deinfer_megatron.models.build import check_parallel_sizes

    for tp in grid.tps:
        check_parallel_sizes(source.arch, tp, 1)
    needed, context = max(grid.prompt_lens) + grid.gen_len, source.arch.max_positions
    if needed > context:
        raise ValueError(f"--prompt-len {max(grid.prompt_lens)} + --gen-len {grid.gen_len} = {needed} exceeds "
                         f"the model's context of {context} tokens; lower one of them")


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


def cell_layout(cell: Cell, source: ModelSource, gen_len: int = 32,
                collectives: dict[str, list[float]] | None = None) -> Layout | LayoutPlan:
    """The layout the cell's ranks build: its fixed layout, or for ``auto`` the cost model's
    plan for the cell's TP, batch, context (prompt + new tokens) and KV cache on this host
    (with ``collectives`` in place of the host table's rates: ``BenchGrid.collectives``)."""
    if cell.layout != AUTO:
        return cell.layout
    from deinfer_megatron.planning.auto import Workload, auto_plan

    work = Workload(tp=cell.tp, batch=cell.batch, context=cell.prompt_len + gen_len,
                    latent_cache=cell.kv_cache is CacheKind.LATENT)
    return auto_plan(source.arch, source.rank_config, work, collectives=collectives).plan


def plan_totals(cell: Cell, source: ModelSource, gen_len: int = 32,
                collectives: dict[str, list[float]] | None = None) -> PlanTotals:
    """The planner's per-token totals for this cell (ValueError when the layout cannot run)."""
    from deinfer_megatron.planning.plan import make_plan

    plan = make_plan(source.arch, source.rank_config, cell_layout(cell, source, gen_len, collectives), tp=cell.tp,
                     batch=cell.batch)
    t = plan.totals
    return PlanTotals(t["collectives_per_token"], t["elements_per_token"], t["params_per_rank"],
                      t["kv_bytes_per_token"][cell.kv_cache.value],
                      tuple(tuple(op) for layer in plan.layers for op in layer.collective_ops))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def run_cell(cell: Cell, source: ModelSource, grid: BenchGrid) -> list[RankMeasurement]:
    """Run ``cell`` in fresh ranks; every rank's measurements, by rank."""
    from deinfer_megatron.bench.measure import CellJob, cell_worker
    from deinfer_megatron.launch.local import spawn_local

    layout = cell_layout(cell, source, grid.gen_len, grid.collectives)
    job = CellJob(source.folder_for(layout), layout, cell.kv_cache, cell.tp, cell.batch,
                  cell.prompt_len, grid.gen_len, grid.repeats,
                  random_prompts(source.arch.vocab_size, cell.batch, cell.prompt_len, grid.seed),
                  profile=grid.profile, max_prefill_tokens=grid.max_prefill_tokens)
    return spawn_local(cell.tp, cell_worker, job, timeout=grid.cell_timeout_s)


Runner = Callable[[Cell, ModelSource, BenchGrid], list[RankMeasurement]]


def run_matrix(grid: BenchGrid, source: ModelSource, runner: Runner = run_cell, *,
               progress: bool = True) -> list[CellRecord]:
    """Every cell's record: measured (with per-rank results), skipped or failed."""
    from tqdm import tqdm

    cells = make_cells(grid)
    records = []
    bar = tqdm(cells, desc="bench", unit="cell", disable=not progress, dynamic_ncols=True)
    for cell in bar:
        bar.set_postfix_str(cell.label())
        head = dict(cell=cell, gen_len=grid.gen_len, repeats=grid.repeats)
        reason = skip_reason(cell, source)
        if reason is not None:
            records.append(CellRecord(**head, status=CellStatus.SKIPPED, reason=reason))
            continue
        plan = plan_totals(cell, source, grid.gen_len, grid.collectives)
        start = time.perf_counter()
        try:
            ranks = runner(cell, source, grid)
        except Exception as err:  # noqa: BLE001 - a failed cell is data; the matrix goes on
            records.append(CellRecord(**head, status=CellStatus.ERROR, plan=plan, error=_first_line(err),
                                      wall_s=time.perf_counter() - start))
            continue
        records.append(CellRecord(**head, status=CellStatus.OK, plan=plan, wall_s=time.perf_counter() - start,
                                  ranks=tuple(ranks)))
    bar.close()
    return records


def skip_reason(cell: Cell, source: ModelSource) -> str | None:
    """Why ``cell`` does not apply to this model (recorded, not an error); None when it does."""
    reason = source.skip_reason(cell.layout, cell.kv_cache)
    if reason is None:
        try:
            plan_totals(cell, source)
        except ValueError as err:  # e.g. dense attention with more ranks than KV heads
            reason = str(err).splitlines()[0]
    return reason


def require_runnable(grid: BenchGrid, source: ModelSource) -> None:
    """One-line error when every cell would be skipped, naming why."""
    reasons = [skip_reason(cell, source) for cell in make_cells(grid)]
    if all(reasons):
        raise ValueError("no configuration can run: " + "; ".join(dict.fromkeys(r for r in reasons if r)))
