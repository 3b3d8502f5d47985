"""``deinfer-megatron fetch-model``: the embedded real model, as a Hugging Face folder."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from deinfer_megatron.checkpoints.embedded import EMBEDDED_MODELS, fetch_model


@dataclass(frozen=True)
class FetchConfig:
    name: str
    out: Path | None = None
    overwrite: bool = False


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch-model", help="convert an embedded model into a Hugging Face folder")
    p.add_argument("name", help=f"one of: {', '.join(EMBEDDED_MODELS)}")
    p.add_argument("--out", type=Path, help="folder to write (default: ~/.cache/deinfer_megatron/NAME); "
                   "must not exist, be empty, or already hold this conversion")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is an earlier conversion by deinfer-megatron (never anything else)")
    p.set_defaults(make_config=lambda a: FetchConfig(a.name, a.out, a.overwrite), run=main)


def main(cfg: FetchConfig) -> int:
    print(fetch_model(cfg.name, cfg.out, overwrite=cfg.overwrite))
    return 0
