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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from deinfer_megatron.bench.sources import ModelSource

LAYOUTS = ("dense", "naive", "deinfer")
KV_CACHES = ("full", "latent")


@dataclass(frozen=True)
class BenchConfig:
    """Everything ``deinfer-megatron bench`` was asked for (validated by ``check_config``)."""

    model: Path | None = None
    synthetic: str | None = None
    ratio: float = 0.6
    layouts: tuple[str, ...] = LAYOUTS
    kv_caches: tuple[str, ...] = ("full",)
    tps: tuple[int, ...] = (1, 2)
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_lens: tuple[int, ...] = (128,)
    gen_len: int = 32
    repeats: int = 3
    seed: int = 0
    json: Path | None = None
    markdown: Path | None = None
    plot: Path | None = None
    roofline: bool = False
    cell_timeout_s: float = 1800.0
    progress: bool = True


@dataclass(frozen=True)
class Cell:
    layout: str
    kv_cache: str
    tp: int
    batch: int
    prompt_len: int

    def label(self) -> str:
        return f"{self.layout}/{self.kv_cache} tp={self.tp} b={self.batch} ctx={self.prompt_len}"


def check_config(cfg: BenchConfig) -> None:
    """Everything that can be rejected before a model is drawn or a rank started."""
    if (cfg.model is None) == (cfg.synthetic is None):
        raise ValueError("give exactly one of --model DIR or --synthetic NAME")
    if cfg.synthetic is not None:
        from deinfer_megatron.decompose.allocation import check_ratio
        from deinfer_megatron.models.synthetic import synthetic_config

        synthetic_config(cfg.synthetic)  # unknown name → names the choices
        check_ratio(cfg.ratio)
    for flag, values, allowed in (("--layouts", cfg.layouts, LAYOUTS), ("--kv-cache", cfg.kv_caches, KV_CACHES)):
        if not values:
            raise ValueError(f"{flag} needs at least one of {','.join(allowed)}")
        for v in values:
            if v not in allowed:
                raise ValueError(f"{flag}: unknown value {v!r}; choose from {','.join(allowed)}")
    for flag, ints in (("--tp", cfg.tps), ("--batch", cfg.batches), ("--prompt-len", cfg.prompt_lens)):
        if not ints:
            raise ValueError(f"{flag} needs at least one positive integer, e.g. {flag} 1,2")
        if min(ints) < 1:
            raise ValueError(f"{flag} values must be positive integers, got {min(ints)}")
    if cfg.gen_len < 2:
        raise ValueError(f"--gen-len must be at least 2 (a decode step follows the first token), got {cfg.gen_len}")
    if cfg.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {cfg.repeats}")
    if cfg.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib; pip install matplotlib") from None


def check_sizes(cfg: BenchConfig, source: ModelSource) -> None:
    """TP sizes and lengths this model cannot take (the same one-line errors as ``plan``)."""
    from deinfer_megatron.models.build import check_parallel_sizes

    for tp in cfg.tps:
        check_parallel_sizes(source.arch, tp, 1)
    needed, context = max(cfg.prompt_lens) + cfg.gen_len, source.arch.max_positions
    if needed > context:
        raise ValueError(f"--prompt-len {max(cfg.prompt_lens)} + --gen-len {cfg.gen_len} = {needed} exceeds "
                         f"the model's context of {context} tokens; lower one of them")


def make_cells(cfg: BenchConfig) -> list[Cell]:
    """The grid in a stable order: prompt length, TP, batch, then layout and KV cache."""
    return [Cell(layout, kv, tp, batch, ctx)
            for ctx in cfg.prompt_lens for tp in cfg.tps for batch in cfg.batches
            for layout in cfg.layouts for kv in cfg.kv_caches]


def random_prompts(vocab: int, batch: int, prompt_len: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """Random token ids, exactly ``prompt_len`` per row; the same for every layout of a cell."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch * 1_009 + prompt_len)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=gen)
    return tuple(tuple(row) for row in ids.tolist())


def plan_totals(cell: Cell, source: ModelSource) -> dict[str, Any]:
    """The planner's per-token totals for this cell (ValueError when the layout cannot run)."""
    from deinfer_megatron.planning.plan import make_plan

    plan = make_plan(source.arch, source.rank_config, cell.layout, tp=cell.tp, batch=cell.batch)
    t = plan.totals
    return {"collectives_per_token": t["collectives_per_token"], "elements_per_token": t["elements_per_token"],
            "params_per_rank": t["params_per_rank"], "kv_bytes_per_token": t["kv_bytes_per_token"][cell.kv_cache],
            "collective_ops": [op for layer in plan.layers for op in layer.collective_ops]}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def run_cell(cell: Cell, source: ModelSource, cfg: BenchConfig) -> list[dict[str, Any]]:
    """Run ``cell`` in fresh ranks; every rank's raw measurements, by rank."""
    from deinfer_megatron.bench.measure import CellJob, cell_worker
    from deinfer_megatron.launch.local import spawn_local

    job = CellJob(source.folder_for(cell.layout), cell.layout, cell.kv_cache, cell.tp, cell.batch,
                  cell.prompt_len, cfg.gen_len, cfg.repeats,
                  random_prompts(source.arch.vocab_size, cell.batch, cell.prompt_len, cfg.seed))
    return spawn_local(cell.tp, cell_worker, job, timeout=cfg.cell_timeout_s)


Runner = Callable[[Cell, ModelSource, BenchConfig], list[dict[str, Any]]]


def cell_record(cell: Cell, cfg: BenchConfig) -> dict[str, Any]:
    return {**asdict(cell), "gen_len": cfg.gen_len, "repeats": cfg.repeats}


def run_matrix(cfg: BenchConfig, source: ModelSource, runner: Runner = run_cell) -> list[dict[str, Any]]:
    """Every cell's record: status "ok" (with per-rank results), "skipped" or "error"."""
    from tqdm import tqdm

    cells = make_cells(cfg)
    records = []
    bar = tqdm(cells, desc="bench", unit="cell", disable=not cfg.progress, dynamic_ncols=True)
    for cell in bar:
        bar.set_postfix_str(cell.label())
        rec = cell_record(cell, cfg)
        reason = skip_reason(cell, source)
        if reason is not None:
            records.append({**rec, "status": "skipped", "reason": reason})
            continue
        rec["plan"] = plan_totals(cell, source)
        start = time.perf_counter()
        try:
            ranks = runner(cell, source, cfg)
        except Exception as err:  # noqa: BLE001 - a failed cell is data; the matrix goes on
            records.append({**rec, "status": "error", "error": _first_line(err),
                            "wall_s": time.perf_counter() - start})
            continue
        records.append({**rec, "status": "ok", "wall_s": time.perf_counter() - start, "ranks": ranks})
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


def require_runnable(cfg: BenchConfig, source: ModelSource) -> None:
    """One-line error when every cell would be skipped, naming why."""
    reasons = [skip_reason(cell, source) for cell in make_cells(cfg)]
    if all(reasons):
        raise ValueError("no configuration can run: " + "; ".join(dict.fromkeys(r for r in reasons if r)))
