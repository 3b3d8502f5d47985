"""``deinfer-megatron plan``: what each layout costs per rank, without running the model."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from deinfer_megatron.checkpoints.folder import RANK_CONFIG, open_config
from deinfer_megatron.cli.arguments import names, parsed_by
from deinfer_megatron.cli.output import emit_json
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.planning.report import format_plans
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig



@dataclass(frozen=True)
class PlanConfig:
    model: Path
    rank_config: Path | None = None
    tp: int = 1
    pp: int = 1
    layout: Layout | None = None
    batch: int = 1
    seq: int = 1
    json: bool = False
    verify: bool = True


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-layer parameters, collectives and KV bytes per rank")
    p.add_argument("--model", type=Path, required=True, help="Hugging Face or decomposed model folder")
    p.add_argument("--rank-config", type=Path, help=f"JSON ranks (default: MODEL/{RANK_CONFIG} if present)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--layout", type=parsed_by(Layout.parse), choices=names(Layout),
                   help="default: all three side by side")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="read a decomposed folder made elsewhere, without its manifest")
    p.set_defaults(make_config=lambda a: PlanConfig(
        a.model, a.rank_config, a.tp, a.pp, a.layout, a.batch, a.seq, a.json, a.verify), run=main)


def main(cfg: PlanConfig) -> int:
    for name, value in (("--tp", cfg.tp), ("--pp", cfg.pp), ("--batch", cfg.batch), ("--seq", cfg.seq)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    arch, ranks = open_config(cfg.model, verify=cfg.verify)  # config and rank config, verified
    if cfg.rank_config is not None:
        ranks = RankConfig.load(cfg.rank_config, arch)
    layouts = [cfg.layout] if cfg.layout else list(Layout)
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
