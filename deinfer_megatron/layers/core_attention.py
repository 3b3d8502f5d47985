"""Scaled dot-product attention over the heads one rank computes.

Megatron's ``DotProductAttention`` derives its head count from the TP size, which is right for
head-sharded layouts but not for the naive baseline, where every rank attends over *all* heads.
This module takes the head counts explicitly from the attention block that owns it, and uses
PyTorch's SDPA (grouped-query attention included) on the ``[s, b, n, d]`` tensors Megatron uses.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SdpaCoreAttention(nn.Module):
    """Causal (or masked) attention; queries are the last ``sq`` positions of the ``sk`` keys.

    Args:
        config: Megatron ``TransformerConfig`` (``softmax_scale`` honoured when set).
        num_heads, num_kv_heads, head_dim: the heads this rank computes.
    Shapes: q ``[sq, b, nq, d]``, k/v ``[sk, b, nkv, d]`` → ``[sq, b, nq·d]``.
    ``attention_mask`` follows Megatron: boolean, True = masked out, broadcastable to
    ``[b, 1, sq, sk]``; it is combined with the causal mask.
    """

    def __init__(
        self,
        config: Any,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_number: int = 0,
        **_: Any,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = config.softmax_scale or 1.0 / math.sqrt(head_dim)
        self.layer_number = layer_number

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
