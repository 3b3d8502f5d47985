"""``deinfer-megatron convert``: a model folder ↔ a Megatron ``torch_dist`` checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from deinfer_megatron.conversion.job import TARGETS, ConvertJob, run_convert


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="model folder ↔ Megatron torch_dist checkpoint (lossless)")
    p.add_argument("--model", type=Path, required=True,
                   help="a model folder (dense or decomposed), or a Megatron checkpoint")
    p.add_argument("--to", choices=TARGETS, required=True,
                   help="megatron: a torch_dist checkpoint (loads at any TP/PP); hf: a model folder")
    p.add_argument("--tp", type=int, help="--to megatron: tensor-parallel ranks that write it (default 1)")
    p.add_argument("--pp", type=int, help="--to megatron: pipeline stages that write it (default 1)")
    p.add_argument("--out", type=Path, required=True, help="output folder; must not exist or be empty")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is a model folder or checkpoint made by deinfer-megatron")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="accept a source without a manifest (made elsewhere); shapes are still checked")
    p.set_defaults(make_config=lambda a: ConvertJob(a.model, a.to, a.out, a.tp, a.pp, a.overwrite, a.verify),
                   run=main)


def main(job: ConvertJob) -> int:
    print(run_convert(job))
    return 0
