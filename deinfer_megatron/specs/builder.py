"""Megatron ``ModuleSpec``s for a decomposed model: one ``TransformerLayer`` spec per layer.

A Megatron user serving a decomposed model swaps one argument:

    block_spec = decomposed_block_spec(config, rank_config, Layout.DEINFER)
    model = GPTModel(config, block_spec, vocab_size, max_seq_len, ...)

Each layer's attention and MLP is either Megatron's dense module (its attention able to run the
server's paged KV pool too: ``PagedSelfAttention``) or the decomposed one with the
layout's factor classes; ranks travel in the spec ``params`` because they differ per layer.
"""

from __future__ import annotations

from typing import Any

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from deinfer_megatron.layers.attention import FactoredAttentionSubmodules, FactoredSelfAttention
from deinfer_megatron.layers.core_attention import SdpaCoreAttention
from deinfer_megatron.layers.dense import CountedColumnParallelLinear, CountedRowParallelLinear, PagedSelfAttention
from deinfer_megatron.specs.layout import (
    FACTOR_CLASSES,
    BlockLayouts,
    FactorClasses,
    Layout,
    LayoutPlan,
    as_plan,
)
from deinfer_megatron.specs.rank_config import LayerRanks, RankConfig


def _norm(config: Any) -> Any:
    return LocalSpecProvider().layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)


def _row(cls: type, number: int, prefix: str, **params: Any) -> ModuleSpec:
    """A linear slot's spec: ``cls`` with its layer number and ledger name (and ``params``)."""
    return ModuleSpec(module=cls, params={"layer_number": number, "prefix": prefix, **params})


def _dense_attention(number: int) -> ModuleSpec:
    return ModuleSpec(
        module=PagedSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=_row(CountedColumnParallelLinear, number, f"{number}.linear_qkv"),
            core_attention=DotProductAttention,
            linear_proj=_row(CountedRowParallelLinear, number, f"{number}.linear_proj"),
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )


def factored_attention_submodules(classes: FactorClasses) -> FactoredAttentionSubmodules:
    """The slots of a decomposed attention block under a layout's factor classes (what the
    spec builds, and what the planner asks for costs)."""
    return FactoredAttentionSubmodules(
        linear_qkv_down=classes.qkv_down,
        linear_q_up=classes.qkv_up,
        linear_k_up=classes.qkv_up,
        linear_v_up=classes.qkv_up,
        core_attention=SdpaCoreAttention,
        linear_proj=classes.row,
    )


def _factored_attention(classes: FactorClasses, ranks: Any, number: int) -> ModuleSpec:
    return ModuleSpec(
        module=FactoredSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "ranks": ranks, "prefix": f"{number}"},
        submodules=factored_attention_submodules(classes),
    )


def _dense_mlp(number: int) -> ModuleSpec:
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(
            linear_fc1=_row(CountedColumnParallelLinear, number, f"{number}.linear_fc1"),
            linear_fc2=_row(CountedRowParallelLinear, number, f"{number}.linear_fc2"),
        ),
    )


def _factored_mlp(classes: FactorClasses, ranks: Any, number: int) -> ModuleSpec:
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(
            linear_fc1=_row(classes.column, number, f"{number}.linear_fc1", ranks=ranks.up_sections),
            linear_fc2=_row(classes.row, number, f"{number}.linear_fc2", ranks=(ranks.down,)),
        ),
    )


def require_dense_attention_fits(num_kv_heads: int, tp: int, layer_index: int) -> None:
    """Megatron's dense attention splits KV heads over ranks; fewer KV heads than ranks would
    make Megatron-Core 0.16.1 all-gather the whole QKV, which this project does not serve."""
    if num_kv_heads < tp:
        raise ValueError(
            f"layer {layer_index}: dense attention needs TP ≤ the number of KV heads "
            f"({num_kv_heads}); decompose the layer's attention or lower --tp"
        )


def require_dense_mlp_fits(ffn_hidden_size: int, tp: int, layer_index: int) -> None:
    """Megatron's dense MLP splits its intermediate size evenly over ranks (the decomposed MLPs
    split their ranks unevenly where they must); SmolLM2's 1536 at TP 9 does not split."""
    if ffn_hidden_size % tp:
        raise ValueError(
            f"layer {layer_index}: a dense MLP needs --tp to divide its intermediate size "
            f"({ffn_hidden_size}), not {tp}; decompose the layer's MLP or pick a --tp that divides it"
        )


def layer_spec(config: Any, ranks: LayerRanks, layout: "Layout | BlockLayouts",
               layer_index: int) -> ModuleSpec:
    """The ``TransformerLayer`` spec of global layer ``layer_index`` (0-based); ``layout`` is one
    layout for both blocks or a ``BlockLayouts`` (one per block)."""
    blocks = layout if isinstance(layout, BlockLayouts) else as_plan(layout, 1).layers[0]
    attn_classes, mlp_classes = FACTOR_CLASSES[blocks.attention], FACTOR_CLASSES[blocks.mlp]
    number = layer_index + 1  # Megatron's layer_number
    attn_ranks = ranks.attention if attn_classes else None
    mlp_ranks = ranks.mlp if mlp_classes else None
    if attn_ranks is None:
        require_dense_attention_fits(config.num_query_groups, config.tensor_model_parallel_size, layer_index)
    if mlp_ranks is None:
        require_dense_mlp_fits(config.ffn_hidden_size, config.tensor_model_parallel_size, layer_index)
    norm = _norm(config)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=(
                _dense_attention(number)
                if attn_ranks is None
                else _factored_attention(attn_classes, attn_ranks, number)
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=_dense_mlp(number) if mlp_ranks is None else _factored_mlp(mlp_classes, mlp_ranks, number),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def decomposed_block_spec(
    config: Any,
    rank_config: RankConfig,
    layout: Layout | LayoutPlan,
    *,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """The decoder-block spec of this pipeline stage for ``GPTModel``.

    Args:
        config: Megatron ``TransformerConfig`` of the whole model.
        rank_config: validated ranks (``RankConfig.dense(arch)`` for a dense model).
        layout: a ``Layout`` (``Layout.DEINFER``, ``NAIVE`` or ``DENSE``) for every block, or a
            ``LayoutPlan`` (a layout per block, e.g. chosen by ``--layout auto``).
        pp_rank: this stage's pipeline rank (Megatron's global state is read when omitted,
            as ``get_gpt_decoder_block_spec`` does).
    """
    if len(rank_config.layers) != config.num_layers:
        raise ValueError(
            f"rank config describes {len(rank_config.layers)} layers, the model has {config.num_layers}"
        )
    plan = as_plan(layout, config.num_layers)
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    specs = [
        layer_spec(config, rank_config.layers[i], plan.layers[i], i) for i in range(offset, offset + count)
    ]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=_norm(config))
