"""The factors as trainable parameters: Megatron's tensor-parallel marks say what the
allocation does (a split dimension is the one that shrinks with TP; a replicated parameter has
the full shape on every rank), and duplicates of replicated KV heads are marked so that
Megatron's gradient norm counts each slice once."""

from __future__ import annotations

import types

import pytest
import torch

from deinfer_megatron.layers.factors import (
    GatheredDown,
    ReducedDown,
    ReducedUp,
    ReplicatedUp,
    ShardedDown,
    ShardedUp,
)
from deinfer_megatron.parallel.topology import TPView

CONFIG = types.SimpleNamespace(params_dtype=torch.float32, perform_initialization=False)
DOWN = dict(input_size=48, section_ranks=(20, 12, 14))
UP = dict(output_size=64, section_ranks=(20,), bias=True, unit_size=8)
CASES = [
    (GatheredDown, DOWN), (ShardedDown, DOWN), (ReducedDown, dict(input_size=48, section_ranks=(20,))),
    (ShardedUp, UP), (ReducedUp, UP), (ReplicatedUp, UP),
]


def _params(cls, args, tp: int, rank: int) -> dict[str, torch.nn.Parameter]:
    return dict(cls(**args, config=CONFIG, tp_group=TPView(rank, tp)).named_parameters())


@pytest.mark.parametrize("cls,args", CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_split_dimension_is_the_one_that_shrinks_with_tp(cls, args) -> None:
    whole = _params(cls, args, 1, 0)
    for name, p in _params(cls, args, 4, 1).items():
        assert p.requires_grad, name
        full = whole[name].shape
        changed = [d for d in range(p.dim()) if p.shape[d] != full[d]]
        if p.tensor_model_parallel:
            assert changed == [p.partition_dim], (cls.__name__, name, p.shape, full)
        else:
            assert changed == [] and p.partition_dim == -1, (cls.__name__, name, p.shape, full)


def test_replicated_kv_heads_are_counted_on_their_first_holder_only() -> None:
    """2 KV heads over 4 ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1; Megatron counts a
    parameter that is not tensor-parallel on TP rank 0 only, so ranks 1 and 3 are marked so."""
    args = dict(output_size=16, section_ranks=(6,), bias=True, unit_size=8)
    marks = [[p.tensor_model_parallel for p in _params(ShardedUp, args, 4, k).values()] for k in range(4)]
    assert marks == [[True, True], [False, False], [True, True], [False, False]]
    heads = [ShardedUp(**args, config=CONFIG, tp_group=TPView(k, 4)).output_span.start for k in range(4)]
    assert heads == [0, 0, 8, 8]
