"""Scaled dot-product attention over the heads one rank computes.

Megatron's ``DotProductAttention`` derives its head count from the TP size, which is right for
head-sharded layouts but not for the naive baseline, where every rank attends over *all* heads.
This module takes the head counts explicitly from the attention block that owns it, and uses
PyTorch's SDPA (grouped-query attention included) on the ``[s, b, n, d]`` tensors Megatron uses.
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.transformer.enums import AttnMaskType

from deinfer_megatron.layers.costs import Attend, Cost
from deinfer_megatron.patches import apply_all

SDPA = "sdpa"  # this module's attention
MEGATRON = "megatron"  # Megatron's DotProductAttention (the dense layout's, Megatron's local spec)


class SdpaCoreAttention(nn.Module):
    """Causal (or masked) attention; queries are the last ``sq`` positions of the ``sk`` keys.

    Takes the keywords Megatron's ``Attention`` gives a ``core_attention`` (those of
    ``DotProductAttention``) plus the head counts; what this module cannot do is refused rather
    than ignored.

    Args:
        config: Megatron ``TransformerConfig`` (``softmax_scale`` used when none is given).
        layer_number: Megatron's 1-based layer number.
        attn_mask_type: must be ``AttnMaskType.causal`` (the mask this module applies).
        attention_type: must be ``"self"``.
        attention_dropout: must be None or 0: no dropout is applied (inference).
        softmax_scale: the scale of ``q·k``; ``config.softmax_scale``, else ``1/sqrt(d)``.
        cp_comm_type: context parallelism is not implemented; must be None.
        pg_collection: accepted for Megatron's signature; nothing here communicates.
        num_heads, num_kv_heads, head_dim: the heads this rank computes.
    Shapes: q ``[sq, b, nq, d]``, k/v ``[sk, b, nkv, d]`` → ``[sq, b, nq·d]``.
    ``attention_mask`` follows Megatron: boolean, True = masked out, broadcastable to
    ``[b, 1, sq, sk]``; it is combined with the causal mask.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int = 0,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type {attn_mask_type} is not supported; this attention is "
                             "causal (use AttnMaskType.causal and pass a padding mask in forward)")
        if attention_type != "self":
            raise ValueError(f"attention_type {attention_type!r} is not supported; only 'self'")
        if attention_dropout:
            raise ValueError(f"attention_dropout {attention_dropout} is not supported (no dropout "
                             "is applied); pass 0 or None")
        if cp_comm_type is not None:
            raise ValueError(f"context parallelism (cp_comm_type {cp_comm_type!r}) is not supported; "
                             "use context_parallel_size=1")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = softmax_scale or config.softmax_scale or 1.0 / math.sqrt(head_dim)
        self.layer_number = layer_number

    @classmethod
    def cost(cls, num_heads: int, num_kv_heads: int, head_dim: int) -> Cost:
        """The attention a decode token costs a rank with these heads (priced per context)."""
        return Cost(attends=(Attend(SDPA, num_heads, num_kv_heads, head_dim),))

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[sq, b, nq, d]`` × ``[sk, b, nkv, d]`` keys → ``[sq, b, nq, dv]`` (values may have
        any width ``dv``: rank-r latents under value absorption)."""
        sq, sk = query.shape[0], key.shape[0]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if sq == 1 and _same_for_every_head(attention_mask):
            return self._attend_one(q, k, v, attention_mask).permute(2, 0, 1, 3)
        if attention_mask is None and sq == sk:
            ctx = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            if attention_mask is not None:
                allowed = allowed & ~attention_mask
            ctx = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=self.scale, enable_gqa=True
            )
        return ctx.permute(2, 0, 1, 3)

    def _attend_one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    attention_mask: torch.Tensor | None) -> torch.Tensor:
        """One query per sequence (a decode step): ``[b, nq, 1, d]`` → ``[b, nq, 1, dv]``.

        The causal mask allows every cached key, so the query heads that share a KV head are
        the rows of one query block against it: ``[b, nkv, nq/nkv, d]`` by ``[b, nkv, sk, d]``.
        Each K/V is read once for its whole group, where SDPA's grouped-query path reads it once
        per query head: the same numbers up to rounding, a fraction of the memory traffic
        (docs/INFERENCE.md has the timing)."""
        b, nq, _, d = q.shape
        nkv = k.shape[1]
        grouped = q.reshape(b, nkv, nq // nkv, d)
        allowed = None if attention_mask is None else ~attention_mask.reshape(-1, 1, 1, attention_mask.shape[-1])
        ctx = F.scaled_dot_product_attention(grouped, k, v, attn_mask=allowed, scale=self.scale)
        return ctx.reshape(b, nq, 1, ctx.shape[-1])

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        sq, b = query.shape[:2]
        ctx = self.attend(query, key, value, attention_mask)
        return ctx.reshape(sq, b, self.num_heads * self.head_dim)


def _same_for_every_head(mask: torch.Tensor | None) -> bool:
    """A padding mask that does not differ by query head (Megatron's ``[b, 1, sq, sk]``, or
    fewer leading dimensions): the grouped single-query path may broadcast it over a group."""
    if mask is None:
        return True
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    return mask.dim() <= 4 and shape[1] == 1 and shape[2] == 1


# ------------------------------------------------------------------ each core as the cost model times it


class _OneRank:
    """The tensor-parallel group of a core built alone: it holds every head it is given."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _sdpa_core(attend: Attend, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    config = types.SimpleNamespace(softmax_scale=None)
    return SdpaCoreAttention(config, num_heads=attend.heads, num_kv_heads=attend.kv_heads,
                             head_dim=attend.head_dim)


def _megatron_core(attend: Attend, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """Megatron's ``DotProductAttention`` over exactly ``attend``'s heads: a TP group of one
    rank holding them, the config flags the project's models use (no fusions, no dropout).
    With ``attend.rotary``, the keys are first rotated by position with Megatron's
    ``apply_rotary_pos_emb``, as its ``SelfAttention.forward`` does to the whole static cache at
    every step (the frequencies, computed once per forward for all layers there, are made
    once per context here, outside the call)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=attend.heads * attend.head_dim, num_attention_heads=attend.heads,
        num_query_groups=attend.kv_heads, kv_channels=attend.head_dim, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False)
    module = DotProductAttention(config, 1, AttnMaskType.causal, "self",
                                 pg_collection=types.SimpleNamespace(tp=_OneRank()))
    if not attend.rotary:
        return lambda q, k, v: module(q, k, v, None)
    rope = RotaryEmbedding(kv_channels=attend.head_dim, rotary_percent=1.0, use_cpu_initialization=True)
    freqs: dict[int, torch.Tensor] = {}

    def rotated_then_attended(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        sk = k.shape[0]
        if sk not in freqs:
            freqs[sk] = rope(sk)
        return module(q, apply_rotary_pos_emb(k, freqs[sk], config=config, cp_group=_OneRank()), v, None)

    return rotated_then_attended


CORES: dict[str, Callable[[Attend, torch.dtype], Callable[..., torch.Tensor]]] = {
    SDPA: _sdpa_core, MEGATRON: _megatron_core}


@contextlib.contextmanager
def standalone_core(attend: Attend, dtype: torch.dtype) -> Iterator[Callable[..., torch.Tensor]]:
    """``attend``'s core attention built on its own, called as its block calls it at a decode
    step: ``(q [1, b, heads, d], k, v [sk, b, kv_heads, d])``. Megatron's needs its global
    memory buffer (its scores' storage): one is set up where no process group made it, and taken
    down after, so that a job later initialising its groups in this process starts as without."""
    from megatron.core import parallel_state

    apply_all()  # Megatron's buffer allocates on torch.cuda.current_device()
    made = parallel_state._GLOBAL_MEMORY_BUFFER is None
    if made:
        parallel_state._set_global_memory_buffer()
    try:
        yield CORES[attend.core](attend, dtype)
    finally:
        if made:
            parallel_state.destroy_global_memory_buffer()
