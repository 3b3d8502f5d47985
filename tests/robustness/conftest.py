"""Models the robustness cases run on: a tiny random LLaMA sharing SmolLM2's tokenizer, dense
and decomposed (every layer, full rank: exact, so outputs can be compared)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Models:
    root: Path
    dense: Path
    decomposed: Path


@pytest.fixture(scope="package")
def models(tmp_path_factory) -> Models:
    from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
    from tests.helpers.tiny_models import full_ranks, save_tiny_folder

    root = tmp_path_factory.mktemp("robust-models")
    hf = save_tiny_folder("llama", root / "dense", max_position_embeddings=4096)
    (root / "ranks.json").write_text(json.dumps(full_ranks(hf)))
    dec = run_decompose(DecomposeJob(root / "dense", "svd", rank_config=root / "ranks.json", out=root / "dec"))
    return Models(root, root / "dense", dec)
