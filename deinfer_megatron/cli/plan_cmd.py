"""``deinfer-megatron plan``: what each layout costs per rank, without running the model."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deinfer_megatron.checkpoints.folder import RANK_CONFIG, open_config
from deinfer_megatron.cli.arguments import parsed_by
from deinfer_megatron.cli.output import emit_json
from deinfer_megatron.parallel.topology import check_parallel_sizes
from deinfer_megatron.planning.auto import table_for
from deinfer_megatron.planning.pricing import Workload, choose_layouts
from deinfer_megatron.planning.cost_model import CostTable
from deinfer_megatron.planning.plan import Plan, make_plan
from deinfer_megatron.planning.report import format_plans
from deinfer_megatron.planning.request import AUTO, LayoutRequest, choices
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig



@dataclass(frozen=True)
class PlanConfig:
    model: Path
    rank_config: Path | None = None
    tp: int = 1
    pp: int = 1
    layout: LayoutRequest | None = None  # a fixed layout, auto, or None: the fixed layouts side by side
    batch: int = 1
    seq: int = 1
    json: bool = False
    verify: bool = True
    cost_table: Path | None = None  # --layout auto: a measured table instead of this host's


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-layer parameters, collectives and KV bytes per rank")
    p.add_argument("--model", type=Path, required=True, help="Hugging Face or decomposed model folder")
    p.add_argument("--rank-config", type=Path, help=f"JSON ranks (default: MODEL/{RANK_CONFIG} if present)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--layout", type=parsed_by(LayoutRequest.parse), metavar="{" + ",".join(choices()) + "}",
                   help="default: the three fixed layouts side by side; auto: the cost model's "
                        "choice per block and the predicted decode step")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--cost-table", type=Path,
                   help="with --layout auto: a cost table JSON (default: this host's, measured once and cached)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="read a decomposed folder made elsewhere, without its manifest")
    p.set_defaults(make_config=lambda a: PlanConfig(
        a.model, a.rank_config, a.tp, a.pp, a.layout, a.batch, a.seq, a.json, a.verify, a.cost_table), run=main)


def main(cfg: PlanConfig) -> int:
    for name, value in (("--tp", cfg.tp), ("--pp", cfg.pp), ("--batch", cfg.batch), ("--seq", cfg.seq)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    arch, ranks = open_config(cfg.model, verify=cfg.verify)  # config and rank config, verified
    check_parallel_sizes(arch, cfg.tp, cfg.pp)
    if cfg.rank_config is not None:
        ranks = RankConfig.load(cfg.rank_config, arch)
    if cfg.layout is not None and cfg.layout.is_auto:
        plans = [auto_plan_with_prediction(arch, ranks, cfg)]
        if cfg.json:
            emit_json(plans[0].to_json(), indent=1)
        else:
            print(format_plans(plans))
        return 0
    if cfg.cost_table is not None:
        raise ValueError("--cost-table is read by --layout auto only; add --layout auto or drop it")
    layouts = [cfg.layout.fixed] if cfg.layout else list(Layout)
    plans, skipped = [], []
    for layout in layouts:
        try:
            plans.append(make_plan(arch, ranks, layout, tp=cfg.tp, pp=cfg.pp, batch=cfg.batch, seq=cfg.seq))
        except ValueError as err:
            if cfg.layout:  # the one layout asked for cannot run: that is the answer
                raise
            skipped.append(f"{layout.value}: {err}")
    if not plans:
        raise ValueError("no layout can run this model at these sizes: " + "; ".join(skipped))
    for note in skipped:
        print(f"note: layout {note}", file=sys.stderr)
    if cfg.json:
        docs = [p.to_json() for p in plans]
        emit_json(docs[0] if cfg.layout else docs, indent=1)
    else:
        print(format_plans(plans))
    return 0


def load_table(path: Path) -> CostTable:
    """A cost table from ``--cost-table``, trusted as given (the user chose it)."""
    import json

    try:
        return CostTable.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ValueError(f"--cost-table {path} does not exist") from None
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise ValueError(f"--cost-table {path} is not a cost table ({err}); write one with `plan --layout auto`'s cache") from None


def auto_plan_with_prediction(arch: Any, ranks: RankConfig, cfg: PlanConfig) -> Plan:
    """The plan of ``--layout auto`` with the cost model's predicted decode step (the chosen
    plan's and every runnable fixed layout's) in its totals."""
    work = Workload(tp=cfg.tp, batch=cfg.batch, context=cfg.seq)
    table = load_table(cfg.cost_table) if cfg.cost_table is not None else table_for(arch, ranks, work)
    choice = choose_layouts(arch, ranks, work, table)
    plan = make_plan(arch, ranks, choice.plan, tp=cfg.tp, pp=cfg.pp, batch=cfg.batch, seq=cfg.seq)
    predicted = {AUTO: choice.step_seconds}
    for layout in Layout:
        seconds = choice.fixed_step_seconds(layout)
        if seconds is not None:
            predicted[layout.value] = seconds
    plan.totals["predicted_decode_step_s"] = predicted
    return plan
