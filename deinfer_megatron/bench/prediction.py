"""The cost model's predicted decode step beside every measured cell's (issue 10's validation:
predicted within 15 % of measured).

A cell is priced as ``--layout auto`` prices it — this host's cost table (``host_table``: measured
once, cached), the cell's TP, batch, context (prompt + new tokens) and KV cache — and the step
predicted is the one of the plan the cell built: auto's choice for an ``auto`` cell, the fixed
layout's for the others (``AutoChoice.fixed_step_seconds``). The measured figure is the cell's
median TPOT (``Summary.tpot_s``), the same decode step the prediction is of.
"""

from __future__ import annotations

import math
from typing import Any

from deinfer_megatron.bench.records import CellRecord, Prediction
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.specs.layout import AUTO, Layout


def _plan_name(choice: Any) -> str:
    """``auto`` with its blocks' layouts counted, e.g. ``auto (attention deinfer×4; mlp dense×4)``."""
    from collections import Counter

    parts = []
    for block in ("attention", "mlp"):
        counts = Counter(getattr(b, block).value for b in choice.plan.layers)
        parts.append(f"{block} " + ", ".join(f"{k}×{v}" for k, v in sorted(counts.items())))
    return "auto (" + "; ".join(parts) + ")"


def predict(rec: CellRecord, source: Any, table: Any = None) -> Prediction | None:
    """The prediction for a measured, summarised cell; None where its layout cannot be priced."""
    from deinfer_megatron.planning.auto import Workload, auto_plan

    assert rec.summary is not None, "predict a summarised cell"
    cell = rec.cell
    work = Workload(tp=cell.tp, batch=cell.batch, context=cell.prompt_len + rec.gen_len,
                    latent_cache=cell.kv_cache is CacheKind.LATENT)
    choice = auto_plan(source.arch, source.rank_config, work, table)
    if cell.layout == AUTO:
        predicted, chosen = choice.step_seconds, _plan_name(choice)
    else:
        layout = Layout.parse(cell.layout)
        predicted, chosen = choice.fixed_step_seconds(layout), layout.value
    if predicted is None or math.isnan(predicted):
        return None
    measured = rec.summary.tpot_s
    return Prediction(predicted, measured, predicted / measured, chosen)


def markdown_lines(records: Any) -> list[str]:
    """The table of predicted against measured decode steps (cells that have one)."""
    rows = [r for r in records if r.prediction is not None]
    if not rows:
        return []
    lines = ["", "## Predicted against measured decode step (cost model, `planning.auto`)", "",
             "| layout | kv | tp | batch | ctx | predicted ms | measured TPOT ms | predicted / measured | plan |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, p = r.cell, r.prediction
        lines.append(f"| {c.layout_name} | {c.kv_cache.value} | {c.tp} | {c.batch} | {c.prompt_len} | "
                     f"{p.predicted_s * 1e3:.2f} | {p.measured_s * 1e3:.2f} | {p.predicted_over_measured:.2f} | "
                     f"{p.chosen} |")
    return lines
