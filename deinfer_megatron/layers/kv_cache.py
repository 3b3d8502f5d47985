"""Per-layer KV-cache storage for decomposed attention, in Megatron's static-batching protocol.

A cache lives in ``inference_context.key_value_memory_dict[layer_number]`` — the slot Megatron's
own attention uses — so Megatron's static inference engine and the project's own loop drive it
alike. Buffers are allocated once, for ``max_sequence_length × max_batch_size`` token slots
(one slot row per request), on the layer's first forward under that context.

* ``FullKVCache``: K (after RoPE) and V of the heads this rank attends over.
* ``LatentKVCache``: the rank-r latents ``c_k = V_k x`` and ``c_v = V_v x`` (before RoPE);
  width r_k + r_v per token, whatever the number of heads. K and V are rebuilt from them.

Which one a context wants is ``inference_context.kv_cache`` (a ``CacheKind``; full unless
set), and ``inference_context.absorb_values`` chooses value absorption for single-token decode
steps.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch


class CacheKind(str, Enum):
    """What a layer keeps per token: its heads' K and V, or the rank-r latents."""

    FULL = "full"
    LATENT = "latent"

    @classmethod
    def parse(cls, value: "str | CacheKind") -> "CacheKind":
        """The kind named ``value``; the one place an unknown name is refused."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown KV cache kind {value!r}; choose one of {', '.join(m.value for m in cls)}"
            ) from None


class _Cache:
    """Two preallocated buffers ``[max_seq, max_batch, ...]`` written at the context's offsets."""

    def __init__(self, context: Any, shapes: tuple[tuple[int, ...], tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        seq, batch = context.max_sequence_length, context.max_batch_size
        self.a = torch.zeros(seq, batch, *shapes[0], dtype=dtype, device=device)
        self.b = torch.zeros(seq, batch, *shapes[1], dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def store_and_read(
        self, a: torch.Tensor, b: torch.Tensor, context: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new entries at the context's offsets; return everything cached so far for
        this batch (``[end, batch, ...]`` views)."""
        start = context.sequence_len_offset
        end = start + a.shape[0]
        if end > self.a.shape[0]:
            raise RuntimeError(
                f"sequence of {end} tokens exceeds the KV cache of {self.a.shape[0]}; "
                "raise the maximum sequence length (or --kv-budget-gb)"
            )
        b0 = context.batch_size_offset
        b1 = b0 + a.shape[1]
        self.a[start:end, b0:b1] = a
        self.b[start:end, b0:b1] = b
        return self.a[:end, b0:b1], self.b[:end, b0:b1]


class FullKVCache(_Cache):
    """K (post-RoPE) and V: ``[seq, batch, kv_heads, head_dim]`` each."""

    def __init__(self, context: Any, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(context, ((kv_heads, head_dim), (kv_heads, head_dim)), dtype, device)


class LatentKVCache(_Cache):
    """Pre-RoPE latents: ``[seq, batch, r_k]`` and ``[seq, batch, r_v]``."""

    def __init__(self, context: Any, rank_k: int, rank_v: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(context, ((rank_k,), (rank_v,)), dtype, device)


def cache_mode(context: Any) -> tuple[CacheKind, bool]:
    """``(kind, absorb_values)`` requested by an inference context."""
    return CacheKind.parse(getattr(context, "kv_cache", CacheKind.FULL)), bool(getattr(context, "absorb_values", True))
