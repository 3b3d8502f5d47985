"""Self-attention whose projections are decomposed, in any layout.

The block is layout-agnostic: the layout only chooses which factor classes fill the slots of
``FactoredAttentionSubmodules``. The number of heads this rank attends over is read back from
what the up factors produce — head-sharded for DeInfer (``ShardedUp``), all heads for the naive
baseline (``ReducedUp``) — so there is no layout branch here.

Data flow (DeInfer): ``x → V_qkv x`` (merged GEMM, one all-gather of r_q+r_k+r_v) → ``U_q, U_k,
U_v`` for this rank's heads → RoPE → attention → ``linear_proj`` (V_o on this rank's head dims,
one all-reduce of r_o, replicated U_o). Megatron's ``TransformerLayer`` builds this module in
its ``self_attention`` slot and calls it with Megatron's attention signature.

Under an inference context the layer caches either K/V of its own heads or — with the latent
cache — the pre-RoPE latents ``c_k``, ``c_v``, from which it rebuilds its heads' K (RoPE by
each token's position) and, for single-token decode steps, absorbs ``U_v`` after attention.
Under a ``PagedContext`` (the server's continuous batching) every token has its own sequence,
position and KV block: ``paged_cache.paged_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from deinfer_megatron.arch.ranks import AttentionRanks
from deinfer_megatron.layers.costs import Cost
from deinfer_megatron.layers.kv_cache import CacheKind, FullKVCache, LatentKVCache, cache_mode
from deinfer_megatron.layers.sharded_state import children_sharded_state_dict
from deinfer_megatron.layers.paged_cache import PagedContext, paged_attention
from deinfer_megatron.parallel.topology import Span, TPView


@dataclass
class FactoredAttentionSubmodules:
    """One slot per factor of the decomposed q/k/v/o projections.

    linear_qkv_down: the merged ``[V_q; V_k; V_v]`` (a down factor with three sections).
    linear_q_up / linear_k_up / linear_v_up: ``U_q``, ``U_k``, ``U_v`` (up factors).
    core_attention: attention over the heads this rank holds.
    linear_proj: the decomposed output projection (a ``FactoredLinear``: V_o then U_o).
    """

    linear_qkv_down: Union[ModuleSpec, type, None] = None
    linear_q_up: Union[ModuleSpec, type, None] = None
    linear_k_up: Union[ModuleSpec, type, None] = None
    linear_v_up: Union[ModuleSpec, type, None] = None
    core_attention: Union[ModuleSpec, type, None] = None
    linear_proj: Union[ModuleSpec, type, None] = None


_SUFFIX = {  # factor slot → its name in errors and in the communication ledger
    "linear_qkv_down": "qkv_down",
    "linear_q_up": "q_up",
    "linear_k_up": "k_up",
    "linear_v_up": "v_up",
    "linear_proj": "proj",
}


def _module_class(spec: Union[ModuleSpec, type, None], slot: str) -> type:
    """The class a submodule slot builds (a spec's ``params`` only name the layer)."""
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    if not isinstance(module, type):
        raise ValueError(f"slot {slot} holds {spec!r}; give it a class or a ModuleSpec of a class")
    return module


class FactoredSelfAttention(MegatronModule):
    """Decomposed self-attention with Megatron's attention constructor and forward signature.

    Args:
        config: Megatron ``TransformerConfig``.
        submodules: the factor classes, chosen by the layout.
        layer_number: Megatron's global 1-based layer number.
        attn_mask_type: Megatron's mask type; handed to ``core_attention``.
        cp_comm_type: Megatron's context-parallel mode (passed only when CP > 1); handed to
            ``core_attention``, which refuses it.
        pg_collection: process groups; ``tp`` and ``cp`` are used.
        ranks: ranks of q, k, v and o for this layer.
        prefix: the layer's name, for errors and communication accounting.
    Shapes: ``hidden_states [s, b, h]`` → ``([s, b, h], bias or None)``.

    With ``config.perform_initialization`` the q/k/v factors are initialised with
    ``config.init_method`` and ``linear_proj`` with ``config.output_layer_init_method``: what
    Megatron gives its ``linear_qkv`` and ``linear_proj``.
    """

    def __init__(
        self,
        config: Any,
        submodules: FactoredAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        *,
        ranks: AttentionRanks,
        prefix: str = "",
    ) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            raise ValueError(f"{prefix}: pg_collection (with tp and cp groups) is required")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.cp_group = getattr(pg_collection, "cp", None)
        args = self._slot_args(config, ranks)
        common = dict(config=config, tp_group=pg_collection.tp, layer_number=layer_number)

        def build(slot: str, **extra: Any) -> Any:
            return build_module(getattr(submodules, slot), **args[slot], **common,
                                prefix=f"{prefix}.{_SUFFIX[slot]}", **extra)

        # Megatron gives linear_qkv config.init_method and linear_proj output_layer_init_method.
        self.linear_qkv_down = build("linear_qkv_down", init_method=config.init_method)
        self.linear_q_up = build("linear_q_up", init_method=config.init_method)
        self.linear_k_up = build("linear_k_up", init_method=config.init_method)
        self.linear_v_up = build("linear_v_up", init_method=config.init_method)
        d = self.head_dim = config.kv_channels
        self.num_heads = self.linear_q_up.output_span.size // d
        self.num_kv_heads = self.linear_k_up.output_span.size // d

        self.core_attention = build_module(
            submodules.core_attention,
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="self",
            softmax_scale=config.softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=d,
        )
        self.linear_proj = build(
            "linear_proj",
            init_method=config.output_layer_init_method,
            input_is_parallel=True,
            skip_bias_add=True,
            input_span=self.linear_q_up.output_span,
        )

    @staticmethod
    def _slot_args(config: Any, ranks: AttentionRanks) -> dict[str, dict[str, Any]]:
        """The arguments that size each factor slot — shared by ``__init__`` and ``cost``."""
        d = config.kv_channels
        q_size, kv_size = config.num_attention_heads * d, config.num_query_groups * d
        qkv_bias = bool(config.add_qkv_bias or config.add_bias_linear)
        return {
            "linear_qkv_down": dict(input_size=config.hidden_size,
                                    section_ranks=(ranks.q, ranks.k, ranks.v)),
            "linear_q_up": dict(output_size=q_size, section_ranks=(ranks.q,), bias=qkv_bias, unit_size=d),
            "linear_k_up": dict(output_size=kv_size, section_ranks=(ranks.k,), bias=qkv_bias, unit_size=d),
            "linear_v_up": dict(output_size=kv_size, section_ranks=(ranks.v,), bias=qkv_bias, unit_size=d),
            "linear_proj": dict(input_size=q_size, output_size=config.hidden_size,
                                bias=config.add_bias_linear, ranks=(ranks.o,)),
        }

    @classmethod
    def cost(cls, config: Any, submodules: FactoredAttentionSubmodules, ranks: AttentionRanks,
             tp: TPView) -> Cost:
        """What rank ``tp.rank`` of this block holds, issues per token and caches, without
        building it: the sum of its slots' costs (built with the arguments ``__init__`` gives
        them), and the KV heads the K up factor's row split leaves this rank — all of them
        when U_k is not split by heads (naive), its own when it is (DeInfer) — which are also
        the heads its core attention runs over."""
        args = cls._slot_args(config, ranks)
        slot = {name: _module_class(getattr(submodules, name), name) for name in _SUFFIX}

        def rows(name: str) -> Span:
            return slot[name].output_rows(args[name]["output_size"], args[name]["unit_size"], tp)

        total = Cost()
        for name in ("linear_qkv_down", "linear_q_up", "linear_k_up", "linear_v_up"):
            total += slot[name].cost(**args[name], tp=tp)
        total += slot["linear_proj"].cost(**args["linear_proj"], tp=tp, input_span=rows("linear_q_up"))
        d = config.kv_channels
        heads, kv_heads = rows("linear_q_up").size // d, rows("linear_k_up").size // d
        core = _module_class(submodules.core_attention, "core_attention")
        return total + Cost(kv_heads=kv_heads) + core.cost(heads, kv_heads, d)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """Megatron dist-checkpointing: every factor's own (``layers.sharded_state``); no
        fallback to Megatron's default, which would take each rank's shard for the whole."""
        return children_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def _project(self, up: torch.nn.Module, latent: torch.Tensor, heads: int) -> torch.Tensor:
        out, bias = up((latent,))
        if bias is not None:
            out = out + bias
        return out.view(*out.shape[:2], heads, self.head_dim)

    def _rope(self, x: torch.Tensor, freqs: torch.Tensor | None) -> torch.Tensor:
        if freqs is None:
            return x
        return apply_rotary_pos_emb(x, freqs, config=self.config, cp_group=self.cp_group)

    def _cache(self, context: Any, kind: CacheKind) -> Any:
        """This layer's cache in the context, allocated on first use beside the layer's weights."""
        cache = context.key_value_memory_dict.get(self.layer_number)
        if cache is None:
            dtype, device = self.config.params_dtype, self.linear_qkv_down.weight.device
            if kind is CacheKind.LATENT:
                if not getattr(self.linear_qkv_down, "full_latents", False):
                    raise ValueError(
                        "the latent KV cache needs whole latents on every rank (the deinfer "
                        "layout); this layout keeps them split over ranks"
                    )
                ranks = self.linear_qkv_down.section_ranks
                cache = LatentKVCache(context, ranks[1], ranks[2], dtype, device)
            else:
                cache = FullKVCache(context, self.num_kv_heads, self.head_dim, dtype, device)
            context.key_value_memory_dict[self.layer_number] = cache
        return cache

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        inference_context: Any = None,
        rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        rotary_pos_cos_sin: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        sequence_len_offset: int | None = None,
        *,
        inference_params: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if key_value_states is not None or packed_seq_params is not None:
            raise NotImplementedError("cross-attention and packed sequences are not supported")
        context = inference_context if inference_context is not None else inference_params
        if isinstance(context, PagedContext):  # continuous batching: each token its own sequence and position
            return paged_attention(self, hidden_states, context, rotary_pos_emb)
        sq = hidden_states.shape[0]
        start = context.sequence_len_offset if context is not None else 0
        end = start + sq
        q_emb = k_emb = None
        if rotary_pos_emb is not None:
            q_emb, k_emb = (
                rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            )

        c_q, c_k, c_v = self.linear_qkv_down(hidden_states)
        query = self._rope(self._project(self.linear_q_up, c_q, self.num_heads),
                           None if q_emb is None else q_emb[start:end])
        kind, absorb = cache_mode(context) if context is not None else (None, False)

        if kind is CacheKind.LATENT:
            all_k, all_v = self._cache(context, kind).store_and_read(c_k, c_v, context)
            key = self._rope(self._project(self.linear_k_up, all_k, self.num_kv_heads),
                             None if k_emb is None else k_emb[:end])
            if absorb and sq == 1:  # decode: P·(U_v C_v) = U_v·(P·C_v), exact
                latent_v = all_v.unsqueeze(2).expand(-1, -1, self.num_kv_heads, -1)
                z = self.core_attention.attend(query, key, latent_v, attention_mask)
                z = z.view(sq, z.shape[1], self.num_kv_heads, -1, z.shape[-1])
                context_layer = self.linear_v_up.per_unit(z, self.head_dim).reshape(sq, z.shape[1], -1)
                return self.linear_proj(context_layer)
            value = self._project(self.linear_v_up, all_v, self.num_kv_heads)
        else:
            key = self._rope(self._project(self.linear_k_up, c_k, self.num_kv_heads),
                             None if k_emb is None else k_emb[start:end])
            value = self._project(self.linear_v_up, c_v, self.num_kv_heads)
            if kind is CacheKind.FULL:
                key, value = self._cache(context, kind).store_and_read(key, value, context)

        context_layer = self.core_attention(query, key, value, attention_mask)
        return self.linear_proj(context_layer)
