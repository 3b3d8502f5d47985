"""``random_state`` writes, for any family's architecture, exactly the tensors the name table
expects (``expected_shapes``: names, shapes, factors of the decomposed matrices, biases)."""

from __future__ import annotations

import pytest
import torch

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.checkpoints.hf_names import expected_shapes
from deinfer_megatron.models.synthetic import random_state
from deinfer_megatron.specs.rank_config import RankConfig
from tests.helpers.tiny_models import TINY_CONFIGS


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_random_state_holds_every_tensor_the_name_table_expects(family: str) -> None:
    arch = arch_from_hf_config(TINY_CONFIGS[family])
    first = {**arch.attention_modules(0), **arch.mlp_modules(0)}.values()
    ranks = {name: 4 for name in first}  # layer 0 decomposed, the others dense
    shapes = expected_shapes(arch, RankConfig.from_mapping(ranks, arch))
    state = random_state(arch, ranks, seed=0)
    required = {name for name, (_, needed) in shapes.items() if needed}
    assert required <= set(state) <= set(shapes), sorted(set(state) ^ required)
    assert {name: tuple(t.shape) for name, t in state.items()} == {name: shapes[name][0] for name in state}
    biases = [t for name, t in state.items() if name.endswith(".bias") and "norm" not in name]
    assert bool(biases) == arch.qkv_bias and all(not t.any() for t in biases)
    assert all(torch.isfinite(t).all() for t in state.values())
