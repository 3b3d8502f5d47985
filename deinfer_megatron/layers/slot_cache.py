"""KV memory in request slots, for continuous batching: every row has its own slot and position.

Megatron's static context (``kv_cache.py``) makes all rows of a batch share one position
counter, which is right for one batch that starts together and wrong for a server, where a
request joins at any step and leaves when it is done. Here a step names, for each row of its
batch, the slot that row's request owns and the position its first token sits at
(``SlotContext.begin_step``); the cache writes each row's new entries at its own positions of
its own slot, and attention reads every row's whole slot with a mask that hides the positions
past the row's own. A slot freed by a finished request is reused as is: what the last request
left there lies past the new request's positions, hence masked, and is overwritten as it grows.

The buffers are ``[tokens_per_slot, slots, ...]`` — the layout of ``kv_cache._Cache`` — so
both cache kinds (full K/V of a rank's heads, or the rank-r latents) keep their shapes.
``slot_attention`` is the forward of ``FactoredSelfAttention`` under a ``SlotContext``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.inference.contexts.static_context import StaticInferenceContext

from deinfer_megatron.layers.kv_cache import CacheKind


class SlotContext(StaticInferenceContext):
    """An inference context of ``slots`` request slots of ``tokens_per_slot`` tokens each.

    It is a ``StaticInferenceContext`` to Megatron's model (rotary tables sized
    ``tokens_per_slot``, logits of the last token of each row only); decomposed attention
    reads ``slots_of_rows`` / ``starts_of_rows`` instead of the shared offset.

    Args:
        slots: request slots (rows of the buffers).
        tokens_per_slot: the most tokens one request holds (prompt + generated).
        kv_cache: which cache the decomposed layers keep (``CacheKind``).
        absorb_values: latent cache, single-token steps: fold ``U_v`` in after attention.
    """

    def __init__(self, slots: int, tokens_per_slot: int, *, kv_cache: CacheKind = CacheKind.FULL,
                 absorb_values: bool = True) -> None:
        super().__init__(slots, tokens_per_slot)
        self.kv_cache = CacheKind.parse(kv_cache)
        self.absorb_values = absorb_values
        self.slots_of_rows: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # [s, rows]
        self.masked: torch.Tensor | None = None  # [rows, 1, s, end]: key past the query's position
        self.end = 0  # keys read per row: up to the furthest position of the step

    def begin_step(self, slots: list[int], starts: list[int], length: int, device: torch.device) -> None:
        """The next forward's rows: row i writes positions ``starts[i] .. starts[i]+length-1``
        of slot ``slots[i]``. Positions and the mask are made here once for every layer."""
        if len(set(slots)) != len(slots):
            raise RuntimeError(f"two rows of one step share a slot: {slots}")
        if any(not 0 <= s < self.max_batch_size for s in slots):
            raise RuntimeError(f"slot out of range 0..{self.max_batch_size - 1}: {slots}")
        if any(p < 0 or p + length > self.max_sequence_length for p in starts):
            raise RuntimeError(f"a row's positions run past the {self.max_sequence_length} tokens of a slot")
        self.slots_of_rows = torch.tensor(slots, dtype=torch.long, device=device)
        first = torch.tensor(starts, dtype=torch.long, device=device)
        self.positions = first.unsqueeze(0) + torch.arange(length, device=device).unsqueeze(1)
        self.end = max(starts) + length
        keys = torch.arange(self.end, device=device)
        self.masked = (keys.view(1, 1, -1) > self.positions.t().unsqueeze(-1)).unsqueeze(1)

    def cache_bytes(self) -> int:
        """Bytes this rank holds in slot caches."""
        return sum(c.nbytes for c in self.key_value_memory_dict.values())


class SlotKVCache:
    """Two buffers ``[tokens_per_slot, slots, *shape]``; each row writes at its own positions."""

    def __init__(self, context: SlotContext, shapes: tuple[tuple[int, ...], tuple[int, ...]],
                 dtype: torch.dtype, device: torch.device | str) -> None:
        seq, slots = context.max_sequence_length, context.max_batch_size
        self.a = torch.zeros(seq, slots, *shapes[0], dtype=dtype, device=device)
        self.b = torch.zeros(seq, slots, *shapes[1], dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def store_and_read(self, a: torch.Tensor, b: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``a, b [s, rows, ...]`` at ``positions [s, rows]`` of each row's slot; return
        each row's slot up to ``end`` tokens (``[end, rows, ...]``)."""
        columns = slots.unsqueeze(0).expand_as(positions)
        self.a[positions, columns] = a.to(self.a.dtype)
        self.b[positions, columns] = b.to(self.b.dtype)
        return self.a[:end, slots], self.b[:end, slots]


def _freqs_at(emb: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor | None:
    """Rotary angles ``[max_seq, 1, 1, d]`` at each row's positions ``[s, rows]`` → ``[s, rows, 1, d]``."""
    return None if emb is None else emb[:, 0, 0][positions].unsqueeze(2)


def _cache(attn: Any, context: SlotContext, kind: CacheKind) -> SlotKVCache:
    cache = context.key_value_memory_dict.get(attn.layer_number)
    if cache is None:
        dtype, device = attn.config.params_dtype, attn.linear_qkv_down.weight.device
        if kind is CacheKind.LATENT:
            if not getattr(attn.linear_qkv_down, "full_latents", False):
                raise ValueError("the latent KV cache needs whole latents on every rank (the deinfer "
                                 "layout); this layout keeps them split over ranks")
            ranks = attn.linear_qkv_down.section_ranks
            shapes: tuple = ((ranks[1],), (ranks[2],))
        else:
            shapes = ((attn.num_kv_heads, attn.head_dim),) * 2
        cache = context.key_value_memory_dict[attn.layer_number] = SlotKVCache(context, shapes, dtype, device)
    return cache


def slot_attention(attn: Any, hidden_states: torch.Tensor, context: SlotContext,
                   rotary_pos_emb: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``FactoredSelfAttention.forward`` under a ``SlotContext``: ``[s, rows, h]`` → ``([s, rows, h], bias)``.

    Row i's queries sit at positions ``starts[i] + 0..s-1``; they see the keys of their own slot
    at positions up to their own (the mask), which is causal attention over that request alone.
    """
    assert context.slots_of_rows is not None, "SlotContext.begin_step names the rows before a forward"
    sq, rows = hidden_states.shape[:2]
    slots, positions, masked, end = context.slots_of_rows, context.positions, context.masked, context.end
    assert positions is not None and positions.shape == (sq, rows), "the step's rows are those of the forward"
    q_emb = k_emb = None
    if rotary_pos_emb is not None:
        q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2

    c_q, c_k, c_v = attn.linear_qkv_down(hidden_states)
    query = attn._rope(attn._project(attn.linear_q_up, c_q, attn.num_heads), _freqs_at(q_emb, positions))
    kind = context.kv_cache
    cache = _cache(attn, context, kind)
    if kind is CacheKind.LATENT:
        all_k, all_v = cache.store_and_read(c_k, c_v, positions, slots, end)
        key = attn._rope(attn._project(attn.linear_k_up, all_k, attn.num_kv_heads),
                         None if k_emb is None else k_emb[:end])
        if context.absorb_values and sq == 1:  # decode: P·(U_v C_v) = U_v·(P·C_v), exact
            latent_v = all_v.unsqueeze(2).expand(-1, -1, attn.num_kv_heads, -1)
            z = attn.core_attention.attend(query, key, latent_v, masked)
            z = z.view(sq, rows, attn.num_kv_heads, -1, z.shape[-1])
            context_layer = attn.linear_v_up.per_unit(z, attn.head_dim).reshape(sq, rows, -1)
            return attn.linear_proj(context_layer)
        value = attn._project(attn.linear_v_up, all_v, attn.num_kv_heads)
    else:
        key = attn._rope(attn._project(attn.linear_k_up, c_k, attn.num_kv_heads), _freqs_at(k_emb, positions))
        value = attn._project(attn.linear_v_up, c_v, attn.num_kv_heads)
        key, value = cache.store_and_read(key, value, positions, slots, end)
    return attn.linear_proj(attn.core_attention(query, key, value, masked))
