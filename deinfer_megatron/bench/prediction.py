"""The cost model's predicted decode step beside every measured cell's (issue 10's validation:
predicted within 15 % of measured).

A cell is priced as ``--layout auto`` prices it — this host's cost table (``host_table``: measured
once, cached), the cell's TP, batch, context (prompt + new tokens) and KV cache — and the step
predicted is the one of the plan the cell built: auto's choice for an ``auto`` cell, the fixed
layout's for the others (``AutoChoice.fixed_step_seconds``). The measured figure is the cell's
median TPOT (``Summary.tpot_s``), the same decode step the prediction is of.
"""

from __future__ import annotations

from typing import Any

from deinfer_megatron.bench.records import CellRecord, Prediction
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.planning.auto import auto_plan, table_for
from deinfer_megatron.planning.pricing import Workload, choose_layouts
from deinfer_megatron.specs.layout import LayoutPlan


def _plan_name(choice: Any) -> str:
    """``auto`` with its blocks' layouts counted, e.g. ``auto (attention deinfer×4; mlp dense×4)``."""
    from collections import Counter

    parts = []
    for block in ("attention", "mlp"):
        counts = Counter(getattr(b, block).value for b in choice.plan.layers)
        parts.append(f"{block} " + ", ".join(f"{k}×{v}" for k, v in sorted(counts.items())))
    return "auto (" + "; ".join(parts) + ")"


def plan_seconds(choice: Any, plan: Any) -> float:
    """``choice``'s predicted step for ``plan`` (its per-block prices of every candidate)."""
    return choice.outside_s + sum(layer[b][getattr(blocks, b).value]
                                  for layer, blocks in zip(choice.seconds, plan.layers) for b in ("attention", "mlp"))


def predicted_parts(arch: Any, rank_config: Any, work: Any, table: Any, plan: Any) -> dict[str, float]:
    """The predicted step of ``plan`` in three parts that ``--profile`` measures apart: weights and
    KV reads (GEMMs), collectives, fixed framework time — each the difference of the step priced
    with and without that term (the same formulas, ``planning.auto``)."""
    from dataclasses import replace

    free = {k: [0.0, 1e30] for k in ("all_reduce", "all_gather")}
    whole = plan_seconds(choose_layouts(arch, rank_config, work, table), plan)
    no_fixed = replace(table, overhead={})
    without_fixed = plan_seconds(choose_layouts(arch, rank_config, work, no_fixed), plan)
    compute = plan_seconds(choose_layouts(arch, rank_config, work, replace(no_fixed, collectives=free)), plan)
    return {"weights_kv_s": compute, "collectives_s": without_fixed - compute, "fixed_s": whole - without_fixed}


def predict(rec: CellRecord, source: Any, table: Any = None,
            collectives: dict[str, list[float]] | None = None, dtype: str = "float32") -> Prediction | None:
    """The prediction for a measured, summarised cell; None where its layout cannot be priced.
    ``collectives``: the rates of the link the cell ran over, in place of the table's
    (``BenchGrid.collectives``); ``dtype``: the cells' (``bench --dtype``), whose GEMM rates and
    bytes per element are priced."""
    from dataclasses import replace

    assert rec.summary is not None, "predict a summarised cell"
    cell = rec.cell
    work = Workload(tp=cell.tp, batch=cell.batch, context=cell.prompt_len + rec.gen_len, dtype=dtype,
                    latent_cache=cell.kv_cache is CacheKind.LATENT)
    choice = auto_plan(source.arch, source.rank_config, work, table, collectives)
    if not choice.seconds:  # the fallback of a machine without a cost table
        return None
    if cell.layout.is_auto:
        plan, chosen = choice.plan, _plan_name(choice)
    else:
        layout = cell.layout.fixed
        if choice.fixed_step_seconds(layout) is None:
            return None
        plan, chosen = LayoutPlan.uniform(layout, source.arch.num_layers), layout.value
    table = table or table_for(source.arch, source.rank_config, work)
    if collectives:
        table = replace(table, collectives=collectives)
    parts = predicted_parts(source.arch, source.rank_config, work, table, plan)
    predicted, measured = sum(parts.values()), rec.summary.tpot_s
    return Prediction(predicted, measured, predicted / measured, chosen, parts)


def markdown_lines(records: Any) -> list[str]:
    """The table of predicted against measured decode steps (cells that have one)."""
    rows = [r for r in records if r.prediction is not None]
    if not rows:
        return []
    lines = ["", "## Predicted against measured decode step (cost model, `planning.auto`)", "",
             "| layout | kv | tp | batch | ctx | predicted ms | weights+KV ms | collectives ms | fixed ms "
             "| measured TPOT ms | predicted / measured | plan |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, p = r.cell, r.prediction
        parts = " | ".join(f"{p.parts[k] * 1e3:.2f}" for k in ("weights_kv_s", "collectives_s", "fixed_s"))
        lines.append(f"| {c.layout_name} | {c.kv_cache.value} | {c.tp} | {c.batch} | {c.prompt_len} | "
                     f"{p.predicted_s * 1e3:.2f} | {parts} | {p.measured_s * 1e3:.2f} | "
                     f"{p.predicted_over_measured:.2f} | {p.chosen} |")
    return lines
