"""Initialisation with ``config.perform_initialization``: every factor draws its *full* factors
with the slot's init method and keeps its slice, so the shards of any TP size reassemble to the
same full factors — those ``init_method`` gives a same-seeded full tensor — with padding zero.

Each module is built as "rank k of n" in one process (a ``TPView`` without a group), reseeded
before every rank as every rank of a real job starts from the same seed.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch

from deinfer_megatron.layers.factored_linear import DeInferRowLinear, NaiveFactoredLinear
from deinfer_megatron.layers.factors import (
    GatheredDown,
    ReducedDown,
    ReducedUp,
    ReplicatedUp,
    ShardedDown,
    ShardedUp,
)
from deinfer_megatron.parallel.topology import TPView

SEED = 1234
INIT = functools.partial(torch.nn.init.uniform_, a=-1.0, b=1.0)  # never 0, so padding shows


def config(**overrides):
    base = dict(params_dtype=torch.float64, perform_initialization=True,
                init_method=functools.partial(torch.nn.init.normal_, std=0.02))
    return types.SimpleNamespace(**{**base, **overrides})


def per_rank(cls, tp: int, *args, **kwargs) -> list:
    """The module of every rank of a TP group of ``tp``, each built from the same seed."""
    mods = []
    for k in range(tp):
        torch.manual_seed(SEED)
        mods.append(cls(*args, config=config(), tp_group=TPView(k, tp), init_method=INIT, **kwargs))
    return mods


def drawn(*shapes: tuple[int, int], init=INIT) -> list[torch.Tensor]:
    """What ``init`` gives full float32 tensors of ``shapes``, drawn in order after ``SEED``."""
    torch.manual_seed(SEED)
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=torch.float32)
        init(t)
        out.append(t.double())
    return out


def assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# Reassembly from the documented storage: V as Vᵀ (in, cols), U as Uᵀ (sections, cols, rows).


def full_gathered_v(mods, ranks) -> tuple[list[torch.Tensor], torch.Tensor]:
    merged = torch.cat([m.weight for m in mods], dim=1).T  # padded rows of [V_0; V_1; ...]
    return list(merged[: sum(ranks)].split(ranks)), merged[sum(ranks):]


def full_sharded_v(mods, ranks) -> list[torch.Tensor]:
    out = []
    for s in range(len(ranks)):
        parts = []
        for m in mods:
            lo = sum(m.local_ranks[:s])
            parts.append(m.weight[:, lo : lo + m.local_ranks[s]])
        out.append(torch.cat(parts, dim=1).T)
    return out


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_gathered_down_is_tp_invariant_with_zero_padding(tp: int) -> None:
    ranks = (7, 5, 6)  # Σ = 18: tp 4 pads two rows
    v, padding = full_gathered_v(per_rank(GatheredDown, tp, 16, ranks), ranks)
    assert_equal(v, drawn(*[(r, 16) for r in ranks]))
    assert padding.shape[0] == -(-18 // tp) * tp - 18
    assert torch.all(padding == 0), "padding rows of the merged V stay zero"


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_sharded_down_and_reduced_up_are_tp_invariant(tp: int) -> None:
    ranks = (7, 4)
    assert_equal(full_sharded_v(per_rank(ShardedDown, tp, 12, ranks), ranks), drawn((7, 12), (4, 12)))
    ups = per_rank(ReducedUp, tp, 10, ranks, bias=True)
    u = [torch.cat([m.weight[s, : m.column_spans[s].size] for m in ups], dim=0).T for s in range(2)]
    assert_equal(u, drawn((10, 7), (10, 4)))
    assert all(torch.all(m.bias == 0) for m in ups), "biases start at zero, as Megatron's"


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_sharded_up_is_tp_invariant(tp: int) -> None:
    ranks = (5, 3)  # sections of different ranks: the narrower one is zero-padded per rank
    mods = per_rank(ShardedUp, tp, 12, ranks, bias=False)
    u = [torch.cat([m.weight[s, :r] for m in mods], dim=1).T for s, r in enumerate(ranks)]
    assert_equal(u, drawn((12, 5), (12, 3)))
    assert all(torch.all(m.weight[1, 3:] == 0) for m in mods)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_pair_is_tp_invariant(tp: int) -> None:
    """ReducedDown (input columns split) and ReplicatedUp (whole U on every rank)."""
    v = torch.cat([m.weight for m in per_rank(ReducedDown, tp, 16, (6,))], dim=0).T
    assert_equal([v], drawn((6, 16)))
    for m in per_rank(ReplicatedUp, tp, 10, (6,), bias=True):
        assert_equal([m.weight[0].T], drawn((10, 6)))


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_factored_linear_draws_v_then_u_with_its_init_method(tp: int) -> None:
    mods = per_rank(NaiveFactoredLinear, tp, 12, 10, ranks=(7, 4), stride=2, bias=False)
    v = full_sharded_v([m.down for m in mods], (7, 4))
    u = [torch.cat([m.up.weight[s, : m.up.column_spans[s].size] for m in mods], dim=0).T for s in range(2)]
    assert_equal(v + u, drawn((7, 12), (4, 12), (5, 7), (5, 4)))
    row = per_rank(DeInferRowLinear, tp, 16, 10, ranks=(6,), bias=True)
    v = torch.cat([m.down.weight for m in row], dim=0).T
    assert_equal([v, row[0].up.weight[0].T], drawn((6, 16), (10, 6)))


def test_default_init_method_is_the_configs() -> None:
    torch.manual_seed(SEED)
    m = GatheredDown(16, (4,), config=config(init_method=INIT), tp_group=TPView(0, 1))
    assert_equal([m.weight.T], drawn((4, 16)))


def test_without_perform_initialization_nothing_is_drawn() -> None:
    """The loading path (perform_initialization=False, then a checkpoint) stays as it was:
    no random numbers are drawn, on CPU or on the meta device."""
    state = torch.random.get_rng_state()
    GatheredDown(16, (4, 4), config=config(perform_initialization=False), tp_group=TPView(0, 2))
    with torch.device("meta"):
        m = ShardedUp(12, (5,), config=config(), tp_group=TPView(0, 2), bias=True)
    assert m.weight.is_meta
    assert torch.equal(torch.random.get_rng_state(), state)


def test_attention_slots_get_megatrons_init_methods() -> None:
    """q/k/v factors take ``config.init_method`` (Megatron's linear_qkv), the projection's both
    factors ``config.output_layer_init_method`` (Megatron's linear_proj)."""
    from deinfer_megatron.arch.model import arch_from_hf_config, transformer_config
    from deinfer_megatron.arch.ranks import AttentionRanks
    from deinfer_megatron.layers.attention import FactoredSelfAttention
    from deinfer_megatron.specs.builder import factored_attention_submodules
    from deinfer_megatron.specs.layout import Layout
    from tests.helpers.tiny_models import TINY_CONFIGS

    cfg = transformer_config(arch_from_hf_config(TINY_CONFIGS["llama"]), tp=1, pp=1)
    cfg.perform_initialization = True
    cfg.init_method = functools.partial(torch.nn.init.uniform_, a=-1.0, b=0.0)
    cfg.output_layer_init_method = functools.partial(torch.nn.init.uniform_, a=2.0, b=3.0)
    block = FactoredSelfAttention(
        cfg, factored_attention_submodules(Layout.DEINFER.factor_classes), layer_number=1,
        pg_collection=types.SimpleNamespace(tp=TPView(0, 1), cp=None), ranks=AttentionRanks(8, 6, 5, 7),
    )
    for factor in (block.linear_qkv_down, block.linear_q_up, block.linear_k_up, block.linear_v_up):
        assert bool(((factor.weight >= -1) & (factor.weight <= 0)).all()), factor.prefix
    for factor in (block.linear_proj.down, block.linear_proj.up):
        assert bool(((factor.weight >= 2) & (factor.weight <= 3)).all()), factor.prefix
