"""Build a one-rank stage from a model folder in this process and return its logits."""

from __future__ import annotations

from pathlib import Path

import torch

from deinfer_megatron.launch.run import run_on_ranks
from deinfer_megatron.specs.layout import Layout


def _logits(model: Path, ids: torch.Tensor, layout: str) -> torch.Tensor:
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.models.pipeline import stage_forward
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown

    groups = init_parallel(1, 1)
    try:
        stage = load_folder(model, Layout(layout), groups)
        return stage_forward(stage, ids, torch.arange(ids.shape[1]).expand_as(ids))
    finally:
        shutdown()


def stage_logits(model: Path, ids: torch.Tensor, layout: str = "deinfer") -> torch.Tensor:
    return run_on_ranks(1, _logits, model, ids, layout)
