"""Each factor, built as "rank k of n" in one process: the shards it loads, combined the way its
collective would combine them, reproduce the full matrix product computed directly."""

from __future__ import annotations

import types

import pytest
import torch

from deinfer_megatron.layers.core_attention import SdpaCoreAttention
from deinfer_megatron.layers.factored_linear import (
    DeInferColumnLinear,
    DeInferRowLinear,
    NaiveFactoredLinear,
)
from deinfer_megatron.layers.factors import (
    GatheredDown,
    ReducedDown,
    ReducedUp,
    ReplicatedUp,
    ShardedDown,
    ShardedUp,
)
from deinfer_megatron.parallel.topology import TPView, unit_split, valid_tp_sizes

CONFIG = types.SimpleNamespace(params_dtype=torch.float64, perform_initialization=False)


@pytest.fixture
def randn():
    """Random float64 tensors from a generator of this test's own (no order dependence)."""
    gen = torch.Generator().manual_seed(0)
    return lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)


def build(cls, tp: int, *args, **kwargs):
    """One module per rank of a TP group of size ``tp`` (no process group: shard views)."""
    return [cls(*args, config=CONFIG, tp_group=TPView(k, tp), **kwargs) for k in range(tp)]


def load(module, name: str, source: torch.Tensor, shard: int = 0) -> None:
    loader, _ = module.loader_for(name)
    with torch.no_grad():
        loader(getattr(module, name), source, shard)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_gathered_down_concatenates_to_full_latents(randn, tp: int) -> None:
    ranks = (7, 5, 6)  # Σ = 18: padded for tp = 4 (and tp = 4 splits 18 unevenly)
    vs = [randn(r, 16) for r in ranks]
    x = randn(3, 16)
    mods = build(GatheredDown, tp, 16, ranks)
    for m in mods:
        for s, v in enumerate(vs):
            load(m, "weight", v, s)
    gathered = torch.cat([x @ m.weight for m in mods], dim=-1)  # what all-gather does
    assert gathered.shape[-1] == tp * -(-sum(ranks) // tp)
    assert torch.all(gathered[..., sum(ranks):] == 0), "padding rows must be zero"
    expected = torch.cat([x @ v.T for v in vs], dim=-1)
    torch.testing.assert_close(gathered[..., : sum(ranks)], expected)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_naive_pair_sums_to_full_output(randn, tp: int) -> None:
    """ShardedDown (V rows split) + ReducedUp (U columns split): Σ over ranks = U·V·x."""
    ranks = (7, 4)
    vs, us = [randn(r, 12) for r in ranks], [randn(10, r) for r in ranks]
    x = randn(2, 12)
    downs, ups = build(ShardedDown, tp, 12, ranks), build(ReducedUp, tp, 10, ranks, bias=False)
    for d, u in zip(downs, ups):
        for s in range(2):
            load(d, "weight", vs[s], s)
            load(u, "weight", us[s], s)
    for s in range(2):
        partial = sum(
            (x @ d.weight).split(d.local_ranks, -1)[s] @ u.weight[s, : d.local_ranks[s]]
            for d, u in zip(downs, ups)
        )
        torch.testing.assert_close(partial, x @ vs[s].T @ us[s].T)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_down_sums_and_replicated_up(randn, tp: int) -> None:
    v, u, b = randn(6, 16), randn(10, 6), randn(10)
    x = randn(3, 16)
    downs = build(ReducedDown, tp, 16, (6,))
    ups = build(ReplicatedUp, tp, 10, (6,), bias=True)
    for d, up in zip(downs, ups):
        load(d, "weight", v)
        load(up, "weight", u)
        load(up, "bias", b)
    latent = sum(x[:, d.input_span.slice] @ d.weight for d in downs)  # all-reduce
    for up in ups:
        out, bias = up((latent,))
        torch.testing.assert_close(out + bias, x @ v.T @ u.T + b)


def test_sharded_up_heads_and_gqa_replication(randn) -> None:
    """U_k with 2 KV heads on 4 ranks: ranks 0,1 hold head 0 and ranks 2,3 hold head 1."""
    d, r = 4, 5
    u = randn(2 * d, r)
    mods = build(ShardedUp, 4, 2 * d, (r,), bias=False, unit_size=d)
    for m in mods:
        load(m, "weight", u)
    c = randn(3, r)
    heads = [m((c,))[0] for m in mods]
    full = c @ u.T
    for k, h in enumerate(heads):
        torch.testing.assert_close(h, full[:, (k // 2) * d : (k // 2 + 1) * d])
    assert [unit_split(2, d, TPView(k, 4)).start for k in range(4)] == [0, 0, d, d]


def test_sharded_up_sections_batched_like_megatron_stride(randn) -> None:
    """Two sections (gate, up) with different ranks → [gate_local, up_local] per rank."""
    us = [randn(12, 5), randn(12, 3)]
    cs = [randn(2, 5), randn(2, 3)]
    for tp in (1, 2, 3):
        mods = build(ShardedUp, tp, 12, (5, 3), bias=False)
        for m in mods:
            for s in range(2):
                load(m, "weight", us[s], s)
        outs = [m(cs)[0] for m in mods]
        gate = torch.cat([o[:, : o.shape[1] // 2] for o in outs], -1)
        up = torch.cat([o[:, o.shape[1] // 2 :] for o in outs], -1)
        torch.testing.assert_close(gate, cs[0] @ us[0].T)
        torch.testing.assert_close(up, cs[1] @ us[1].T)


def test_factored_linear_single_rank_matches_dense_with_bias_once(randn) -> None:
    vs, us, bs = [randn(4, 8), randn(6, 8)], [randn(5, 4), randn(5, 6)], [randn(5), randn(5)]
    x = randn(3, 2, 8)
    for cls in (DeInferColumnLinear, NaiveFactoredLinear):
        m = cls(8, 10, config=CONFIG, bias=True, stride=2, ranks=(4, 6), tp_group=TPView(0, 1))
        for s in range(2):
            load(m.down, "weight", vs[s], s)
            load(m.up, "weight", us[s], s)
            load(m.up, "bias", bs[s], s)
        out, bias = m(x)
        assert bias is None
        expected = torch.cat([x @ (u @ v).T + b for u, v, b in zip(us, vs, bs)], dim=-1)
        torch.testing.assert_close(out, expected)


def test_loader_rejects_wrong_shapes_with_the_layer_name(randn) -> None:
    m = GatheredDown(8, (4,), config=CONFIG, tp_group=TPView(0, 1), prefix="3.qkv_down")
    with pytest.raises(ValueError, match=r"3\.qkv_down.*\[5, 8\].*\[4, 8\]"):
        load(m, "weight", randn(5, 8))


def test_collective_without_group_is_a_clear_error(randn) -> None:
    m = GatheredDown(8, (4,), config=CONFIG, tp_group=TPView(1, 2), prefix="qkv")
    with pytest.raises(RuntimeError, match="needs a process group"):
        m(randn(2, 8))


def test_valid_tp_sizes() -> None:
    assert valid_tp_sizes(9, 3, limit=16) == [1, 3, 9]  # SmolLM2
    assert valid_tp_sizes(32, 8, limit=64) == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize(
    "build_it",
    [
        lambda: DeInferColumnLinear(8, 10, config=CONFIG, ranks=(4, 6), stride=2, tp_group=TPView(0, 1),
                                    skip_bias_ad=True),
        lambda: NaiveFactoredLinear(8, 10, config=CONFIG, ranks=4, tp_group=TPView(0, 1), init_metod=None),
        lambda: GatheredDown(8, (4,), config=CONFIG, tp_group=TPView(0, 1), layer_numbr=3),
        lambda: ReducedDown(8, (4,), config=CONFIG, tp_group=TPView(0, 1), input_spam=None),
        lambda: ShardedUp(8, (4,), config=CONFIG, tp_group=TPView(0, 1), bias=False, unit_sise=2),
        lambda: SdpaCoreAttention(CONFIG, num_heads=2, num_kv_heads=1, head_dim=4, atention_type="self"),
    ],
    ids=["column", "naive", "gathered", "reduced", "sharded_up", "core_attention"],
)
def test_misspelled_keyword_is_refused(build_it) -> None:
    """No ``**kwargs`` swallows a typo: the constructor names the unknown keyword."""
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        build_it()


def test_megatron_linear_keywords_are_accepted() -> None:
    """Exactly what Megatron-Core 0.16.1's MLP passes to linear_fc1 and linear_fc2."""
    common = dict(config=CONFIG, init_method=None, bias=False, skip_bias_add=True, is_expert=False,
                  tp_group=TPView(0, 1))
    DeInferColumnLinear(8, 12, gather_output=False, tp_comm_buffer_name="fc1", stride=2, ranks=(3, 4),
                        **common)
    DeInferRowLinear(6, 8, input_is_parallel=True, tp_comm_buffer_name="fc2", ranks=(3,), **common)
