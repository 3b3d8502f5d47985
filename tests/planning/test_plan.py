"""Planner formulas on their own (the parity runs check them against real forwards)."""

from __future__ import annotations

import pytest

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.decompose.allocation import uniform_ranks
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig

SMOLLM2 = dict(
    model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
    tie_word_embeddings=True, max_position_embeddings=8192, hidden_act="silu",
)


@pytest.fixture(scope="module")
def smollm2():
    arch = arch_from_hf_config(SMOLLM2)
    return arch, RankConfig.from_mapping(uniform_ranks(arch, 0.8), arch)


def test_design_formulas_per_layer(smollm2) -> None:
    arch, ranks = smollm2
    h, kv, i = 576, 192, 1536
    r = ranks.layers[0]
    naive = make_plan(arch, ranks, Layout.NAIVE, tp=3).layers[0]
    assert naive.collectives == 7
    assert naive.elements_per_token == 3 * h + 2 * kv + 2 * i  # DESIGN: ≈ 3h + 2kv + 2I
    dense = make_plan(arch, ranks, Layout.DENSE, tp=3).layers[0]
    assert (dense.collectives, dense.elements_per_token) == (2, 2 * h)
    deinfer = make_plan(arch, ranks, Layout.DEINFER, tp=3).layers[0]
    assert [k for k, _ in deinfer.collective_ops] == ["all_gather", "all_reduce", "all_gather", "all_reduce"]
    qkv = r.attention.q + r.attention.k + r.attention.v
    gu = sum(r.mlp.up_sections)
    pad = lambda n: -(-n // 3) * 3  # noqa: E731
    assert deinfer.elements_per_token == pad(qkv) + r.attention.o + pad(gu) + r.mlp.down
    assert deinfer.elements_per_token < dense.elements_per_token * 2 < naive.elements_per_token


def test_kv_cache_bytes(smollm2) -> None:
    arch, ranks = smollm2
    r = ranks.layers[0].attention
    for tp in (1, 3, 9):
        deinfer = make_plan(arch, ranks, Layout.DEINFER, tp=tp).layers[0].kv_bytes_per_token
        naive = make_plan(arch, ranks, Layout.NAIVE, tp=tp).layers[0].kv_bytes_per_token
        kv_heads_local = max(1, 3 // tp)  # 3 KV heads, replicated when TP = 9
        assert deinfer["full"] == 2 * kv_heads_local * 64 * 4
        assert naive["full"] == 2 * 3 * 64 * 4  # naive keeps every head on every rank
        assert deinfer["latent"] == (r.k + r.v) * 4


def test_no_collectives_at_tp1_and_pipeline_totals(smollm2) -> None:
    arch, ranks = smollm2
    plan = make_plan(arch, ranks, Layout.DEINFER, tp=1, pp=3, batch=4, seq=128)
    assert plan.totals["collectives_per_token"] == 0
    assert plan.stages == [(0, 10), (10, 20), (20, 30)]
    stage_params = plan.totals["params_per_stage_rank"]
    assert stage_params[0] - stage_params[1] == arch.vocab_size * arch.hidden_size  # embedding
    assert plan.totals["kv_bytes_for_batch"]["full"] == plan.totals["kv_bytes_per_token"]["full"] * 4 * 128


@pytest.mark.parametrize(
    "tp, pp, layout, message",
    [
        (2, 1, "deinfer", r"--tp 2 .*valid TP sizes: 1, 3, 9"),
        (1, 31, "deinfer", r"--pp 31 must be between 1 and .* \(30\)"),
        (1, 4, "deinfer", r"30 layers do not split evenly over --pp 4"),
        (9, 1, "dense", r"dense attention needs TP ≤ the number of KV heads \(3\)"),
    ],
)
def test_bad_sizes(smollm2, tp: int, pp: int, layout: str, message: str) -> None:
    """Sizes that do not split the model (``check_parallel_sizes``, the one check every command
    makes), and a layout the planner cannot lay out at valid sizes."""
    from deinfer_megatron.parallel.topology import check_parallel_sizes

    arch, ranks = smollm2
    with pytest.raises(ValueError, match=message):
        check_parallel_sizes(arch, tp, pp)
        make_plan(arch, ranks, Layout(layout), tp=tp, pp=pp)


def test_decomposed_attention_replicates_kv_heads_past_their_count(smollm2) -> None:
    arch, ranks = smollm2
    plan = make_plan(arch, ranks, Layout.DEINFER, tp=9)
    assert plan.layers[0].collectives == 4
