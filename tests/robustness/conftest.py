"""Models the robustness cases run on: a tiny random LLaMA sharing SmolLM2's tokenizer, dense
and decomposed (every layer, full rank: exact, so outputs can be compared)."""

from __future__ import annotations

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
    from tests.helpers.tiny_models import full_rank_folders

    root = tmp_path_factory.mktemp("robust-models")
    _, dense, dec = full_rank_folders(root, max_position_embeddings=4096)
    return Models(root, dense, dec)
