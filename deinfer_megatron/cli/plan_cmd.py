"""``deinfer-megatron plan``: what each layout costs per rank, without running the model."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from deinfer_megatron.models.arch import load_arch
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.planning.report import format_plans
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig

RANK_CONFIG_NAME = "rank_config.json"


@dataclass(frozen=True)
class PlanConfig:
    model: Path
    rank_config: Path | None = None
    tp: int = 1
    pp: int = 1
    layout: str | None = None
    batch: int = 1
    seq: int = 1
    json: bool = False


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-layer parameters, collectives and KV bytes per rank")
    p.add_argument("--model", type=Path, required=True, help="Hugging Face or decomposed model folder")
    p.add_argument("--rank-config", type=Path, help=f"JSON ranks (default: MODEL/{RANK_CONFIG_NAME} if present)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--layout", choices=[m.value for m in Layout], help="default: all three side by side")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(make_config=lambda a: PlanConfig(
        a.model, a.rank_config, a.tp, a.pp, a.layout, a.batch, a.seq, a.json), run=main)


def resolve_rank_config(model: Path, explicit: Path | None, arch) -> RankConfig:  # noqa: ANN001
    """The explicit rank config, else the model folder's own, else all-dense."""
    if explicit is not None:
        return RankConfig.load(explicit, arch)
    own = model / RANK_CONFIG_NAME
    return RankConfig.load(own, arch) if own.is_file() else RankConfig.dense(arch)


def main(cfg: PlanConfig) -> int:
    for name, value in (("--tp", cfg.tp), ("--pp", cfg.pp), ("--batch", cfg.batch), ("--seq", cfg.seq)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    arch = load_arch(cfg.model)
    ranks = resolve_rank_config(cfg.model, cfg.rank_config, arch)
    layouts = [cfg.layout] if cfg.layout else [m.value for m in Layout]
    plans, skipped = [], []
    for layout in layouts:
        try:
            plans.append(make_plan(arch, ranks, layout, tp=cfg.tp, pp=cfg.pp, batch=cfg.batch, seq=cfg.seq))
        except ValueError as err:
            if cfg.layout:  # the one layout asked for cannot run: that is the answer
                raise
            skipped.append(f"{layout}: {err}")
    if not plans:
        raise ValueError("no layout can run this model at these sizes: " + "; ".join(skipped))
    for note in skipped:
        print(f"note: layout {note}", file=sys.stderr)
    if cfg.json:
        docs = [p.to_json() for p in plans]
        print(json.dumps(docs[0] if cfg.layout else docs, indent=1))
    else:
        print(format_plans(plans))
    return 0
