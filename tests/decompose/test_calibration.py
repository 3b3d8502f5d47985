"""``LayerRunner`` finds a transformers model's embeddings, positions, layers and final norm from
its family's record and the name table: embedding, every layer in turn, then the final norm and
head give transformers' own logits, for every family (RoPE, and OPT's offset learned positions)."""

from __future__ import annotations

import pytest
import torch

from deinfer_megatron.decompose.calibration import LayerRunner
from tests.helpers.tiny_models import TINY_CONFIGS, random_hf_model


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_layer_by_layer_gives_the_models_logits(family: str) -> None:
    model = random_hf_model(family)
    model.set_attn_implementation("sdpa")  # as decompose loads it: run_layer passes no mask, SDPA is causal
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    runner = LayerRunner(model)
    with torch.no_grad():
        hidden = runner.embed(ids)
        for index in range(len(runner.layers)):
            hidden = runner.run_layer(index, hidden)
        got = runner.logits(hidden)
        want = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
