"""A tiny dense teacher and its low-rank decomposition (quarter-rank plain SVD), with text to
heal on and held-out text (the two disjoint halves of the standard library docs)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class HealPair:
    dense: Path
    dec: Path
    heal_text: Path  # what healing trains on
    held_out: Path  # never seen by decompose or heal


def heal_pair(root: Path) -> HealPair:
    from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
    from tests.helpers.text import real_text_file
    from tests.helpers.tiny_models import save_tiny_folder

    root = Path(root)
    hf = save_tiny_folder("llama", root / "dense", num_hidden_layers=2)
    ranks = {n: max(1, min(m.weight.shape) // 4) for n, m in hf.named_modules()
             if isinstance(m, torch.nn.Linear) and n.startswith("model.layers")}
    (root / "ranks.json").write_text(json.dumps(ranks))
    dec = run_decompose(DecomposeJob(root / "dense", "svd", rank_config=root / "ranks.json", out=root / "dec"))
    (root / "text").mkdir()
    (root / "held").mkdir()
    return HealPair(root / "dense", dec, real_text_file(root / "text", 40_000, "calibration"),
                    real_text_file(root / "held", 20_000, "evaluation"))
