"""Session-wide fixtures: the embedded SmolLM2 model and a lossless (full-rank) decomposition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from tests.helpers.tiny_models import smollm2_dir

    return Path(smollm2_dir())


@pytest.fixture(scope="session")
def smollm2_full_rank(smollm2: Path, tmp_path_factory) -> Path:
    """SmolLM2 decomposed at rank min(out, in) everywhere (plain SVD: exact, no calibration)."""
    from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
    from deinfer_megatron.arch.model import load_arch

    arch = load_arch(smollm2)
    root = tmp_path_factory.mktemp("smollm2-full")
    ranks = {name: min(shape) for name, shape in arch.linear_shapes().items()}
    (root / "ranks.json").write_text(json.dumps(ranks))
    return run_decompose(DecomposeJob(smollm2, "svd", rank_config=root / "ranks.json", out=root / "model"))
