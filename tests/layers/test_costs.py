"""What a block says it costs (``cost``, asked without building it) equals what it allocates and
issues when built and run as "rank k of n" in one process.

Collectives are observed by standing in for ``parallel.comm``'s two operations with fakes that
record the call and return a tensor of the right shape (the numbers are not the point here;
tests/models/test_parity.py checks them on real ranks).
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron.core.transformer import mlp as megatron_mlp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from deinfer_megatron.arch.model import arch_from_hf_config, transformer_config
from deinfer_megatron.arch.ranks import AttentionRanks, MlpRanks
from deinfer_megatron.layers import factors
from deinfer_megatron.layers.attention import FactoredSelfAttention
from deinfer_megatron.layers.core_attention import MEGATRON, SDPA, SdpaCoreAttention
from deinfer_megatron.layers.costs import Attend
from deinfer_megatron.layers.factored_linear import factored_mlp_cost
from deinfer_megatron.parallel.topology import TPView
from deinfer_megatron.planning.pricing import layout_costs
from deinfer_megatron.specs.builder import factored_attention_submodules
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig
from tests.helpers.tiny_models import TINY_CONFIGS

ATTENTION = AttentionRanks(q=13, k=7, v=9, o=11)  # Σ qkv = 29: padded at every TP > 1
MLP_RANKS = {True: MlpRanks((10, 7), 9), False: MlpRanks((10,), 9)}  # gated, or OPT's fc1/fc2
CASES = [(family, layout, tp) for family in ("llama", "qwen2", "opt")
         for layout in ("deinfer", "naive") for tp in (1, 2, 4)]


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture
def fake_comm(monkeypatch):
    """Record (kind, elements per token) of every collective instead of issuing it."""
    seen: list[tuple[str, int]] = []

    def gather(x, tp, *, site, layer, grad="reduce_scatter"):
        if tp.size == 1:
            return x
        seen.append(("all_gather", tp.size * x.shape[-1]))
        return torch.cat([x] * tp.size, dim=-1)

    def reduce(x, tp, *, site, layer):
        if tp.size > 1:
            seen.append(("all_reduce", x.shape[-1]))
        return x

    monkeypatch.setattr(factors.comm, "all_gather_last_dim", gather)
    monkeypatch.setattr(factors.comm, "all_reduce_sum", reduce)
    # forward identities (their backward collectives are checked on real ranks, tests/training)
    monkeypatch.setattr(factors.comm, "copy_to_tp", lambda x, tp, *, site, layer: x)
    monkeypatch.setattr(factors.comm, "sum_weight_grad_over_tp",
                        lambda w, tp, place, take, *, site, layer: w)
    return seen


def _config(family: str, tp: int):
    return transformer_config(arch_from_hf_config(TINY_CONFIGS[family]), tp=tp, pp=1)


@pytest.mark.parametrize("family, layout, tp", CASES)
def test_attention_cost_is_what_the_block_allocates_and_issues(family, layout, tp, fake_comm) -> None:
    cfg = _config(family, tp)
    submodules = factored_attention_submodules(Layout.parse(layout).factor_classes)
    x = torch.randn(3, 2, cfg.hidden_size)
    for k in range(tp):
        view = TPView(k, tp)
        cost = FactoredSelfAttention.cost(cfg, submodules, ATTENTION, view)
        block = FactoredSelfAttention(cfg, submodules, layer_number=1, ranks=ATTENTION,
                                      pg_collection=types.SimpleNamespace(tp=view, cp=None))
        for p in block.parameters():  # storage is empty; any values will do
            torch.nn.init.normal_(p)
        fake_comm.clear()
        attended = []  # (core's name, query heads, KV heads, head dim) of each core attention call
        block.core_attention.register_forward_pre_hook(
            lambda m, args: attended.append(Attend(SDPA, args[0].shape[2], args[1].shape[2], args[0].shape[3])))
        block(x)  # no RoPE: OPT-style; collectives do not depend on positions
        assert cost.params == _params(block), (family, layout, k)
        assert cost.kv_heads == block.num_kv_heads, (family, layout, k)
        assert type(block.core_attention) is SdpaCoreAttention and list(cost.attends) == attended, (family, layout, k)
        assert list(cost.collectives) == fake_comm, (family, layout, k)


@pytest.mark.parametrize("family, layout, tp", CASES)
def test_mlp_cost_is_what_megatrons_mlp_allocates(family, layout, tp, fake_comm, monkeypatch) -> None:
    """Megatron's own ``MLP`` builds our linears with the keywords it passes them (so this also
    checks that our explicit signatures take exactly those). Without torch.distributed Megatron
    would replace the group by None; here the "rank k of n" view is passed through."""
    monkeypatch.setattr(megatron_mlp, "get_tensor_model_parallel_group_if_none",
                        lambda group, is_expert=False: group)
    cfg = _config(family, tp)
    classes = Layout.parse(layout).factor_classes
    ranks = MLP_RANKS[cfg.gated_linear_unit]
    submodules = MLPSubmodules(
        linear_fc1=ModuleSpec(module=classes.column, params={"ranks": ranks.up_sections, "prefix": "fc1"}),
        linear_fc2=ModuleSpec(module=classes.row, params={"ranks": (ranks.down,), "prefix": "fc2"}),
    )
    x = torch.randn(3, 2, cfg.hidden_size)
    for k in range(tp):
        view = TPView(k, tp)
        cost = factored_mlp_cost(cfg, classes.column, classes.row, ranks, view)
        block = MLP(cfg, submodules, ffn_hidden_size=cfg.ffn_hidden_size, tp_group=view)
        for p in block.parameters():
            torch.nn.init.normal_(p)
        fake_comm.clear()
        block(x)
        assert cost.params == _params(block), (family, layout, k)
        assert cost.kv_heads == 0
        assert list(cost.collectives) == fake_comm, (family, layout, k)


@pytest.mark.parametrize("family, tp", [("llama", 1), ("llama", 2), ("opt", 2)])
def test_dense_attention_is_megatrons_over_this_ranks_heads(family, tp) -> None:
    """Megatron's ``DotProductAttention`` divides the query heads and the query groups by the TP
    size (``num_attention_heads_per_partition``, ``num_query_groups_per_partition``); a RoPE
    model's dense attention rotates its cached keys each step (tests/layers/test_dense.py),
    OPT's learned positions do not."""
    arch = arch_from_hf_config(TINY_CONFIGS[family])
    cfg = transformer_config(arch, tp=tp, pp=1)
    cost, _ = layout_costs(cfg, arch, Layout.DENSE, RankConfig.dense(arch).layers[0], TPView(0, tp))
    assert cost.attends == (Attend(MEGATRON, cfg.num_attention_heads // tp, cfg.num_query_groups // tp,
                                   cfg.kv_channels, rotary=family != "opt"),)
