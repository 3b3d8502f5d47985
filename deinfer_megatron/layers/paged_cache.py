"""Block-paged KV memory for continuous batching: one pool of fixed-size blocks per rank.

A server's sequences come and go at any step and are of any length, so reserving
``--max-seq-len`` tokens per sequence wastes most of the memory on short requests. Here every
layer's cache is one pool of ``blocks × block_size`` token entries; a sequence owns a list of
blocks (its block table, chosen by rank 0's scheduler, ``serving.blocks``) and its position
``p`` lives at entry ``p % block_size`` of block ``table[p // block_size]``. Blocks are shared
between sequences whose prompts start alike (prefix caching): a shared block is only ever read,
never written, so no copy is needed.

One forward carries the whole step — every decoding sequence's next token and any number of
prompt chunks — packed into one row of the model (``input_ids [1, T]``), as vLLM and Sarathi do:
the weights are read once for all of them. ``PagedContext.begin_step`` names the rows (start
position, token count, block table) and derives, once for all layers, each token's position and
pool entry and the attention groups: the single-token rows together (one batched attention,
each row masked to its own length), and each multi-token row on its own (causal within the
chunk, after its cached prefix). To Megatron's ``GPTModel`` the context is a dynamic-batching
context, so it keeps only the hidden states of the rows that sample (``last_token_logits``)
before the output layer.

Both cache kinds keep their shapes: ``full`` stores K (after RoPE) and V of the rank's heads,
``latent`` the pre-RoPE rank-r latents ``c_k``, ``c_v``, from which K is rebuilt per step
(RoPE at each key's position) and, for single-token rows, ``U_v`` is absorbed after attention.
``paged_attention`` is the forward of ``FactoredSelfAttention`` under a ``PagedContext``;
``paged_dense_attention`` that of a block the model keeps dense (Megatron's ``SelfAttention``,
``layers.dense.PagedSelfAttention``), which stores its heads' K/V under either kind: a dense
block has no latents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from megatron.core.inference.contexts.base_context import BaseInferenceContext
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

from deinfer_megatron.layers.kv_cache import CacheKind


@dataclass(frozen=True)
class PagedRow:
    """One sequence's part of a step: ``length`` tokens from position ``start``, stored in the
    blocks ``table`` (which covers positions ``0 .. start + length - 1``); ``logits``: its last
    token's logits are wanted (the row samples)."""

    start: int
    length: int
    table: tuple[int, ...]
    logits: bool = True


@dataclass(frozen=True)
class _Group:
    """Rows attended together: ``tokens`` (a slice of the packed tokens), their block tables
    ``[rows, blocks]``, the keys read (``keys``), and the mask ``[rows, 1, 1, keys]`` (True:
    past the row's own length) of single-token rows; a multi-token row needs none (its queries
    are the last ``length`` of its ``keys``)."""

    tokens: slice
    tables: torch.Tensor
    keys: int
    mask: torch.Tensor | None

    @property
    def single(self) -> bool:
        return self.mask is not None


class PagedContext(BaseInferenceContext):
    """An inference context over a pool of ``blocks`` KV blocks of ``block_size`` tokens.

    Args:
        blocks: blocks in every layer's pool (the same block ids in every layer).
        block_size: tokens per block.
        max_sequence_length: the most tokens one sequence reaches (Megatron's rotary tables).
        kv_cache: which cache the decomposed layers keep (``CacheKind``).
        absorb_values: latent cache, single-token rows: fold ``U_v`` in after attention.
    """

    def __init__(self, blocks: int, block_size: int, max_sequence_length: int, *,
                 kv_cache: CacheKind = CacheKind.FULL, absorb_values: bool = True) -> None:
        super().__init__(materialize_only_last_token_logits=True)
        if blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of one token, got {blocks} × {block_size}")
        self.blocks, self.block_size = blocks, block_size
        self.max_sequence_length = max_sequence_length
        self.kv_cache = CacheKind.parse(kv_cache)
        self.absorb_values = absorb_values
        self.key_value_memory_dict: dict[int, PagedKVCache] = {}
        self.positions: torch.Tensor | None = None  # [T, 1]
        self.entries: torch.Tensor | None = None  # [T]: pool entry each token writes
        self.groups: list[_Group] = []
        self._sampled: torch.Tensor | None = None  # [n]: packed index of each sampled row's last token

    def is_static_batching(self) -> bool:
        """To Megatron a packed, dynamic batch: it keeps only ``last_token_logits``' rows."""
        return False

    def is_decode_only(self) -> bool:
        """Every row of the step feeds one token (Megatron asks, to chunk a prefill's MLP)."""
        return bool(self.groups) and all(g.single for g in self.groups)

    def begin_step(self, rows: Sequence[PagedRow], device: torch.device | str) -> None:
        """The next forward's rows, packed in this order: positions, pool entries and attention
        groups are made here once for every layer."""
        if not rows:
            raise RuntimeError("a step needs at least one row")
        size = self.block_size
        positions, entries, sampled = [], [], []
        count = 0
        for row in rows:
            end = row.start + row.length
            if row.length < 1 or row.start < 0 or end > self.max_sequence_length:
                raise RuntimeError(f"row of {row.length} tokens from {row.start} lies outside "
                                   f"0..{self.max_sequence_length}")
            if len(row.table) * size < end or any(not 0 <= b < self.blocks for b in row.table):
                raise RuntimeError(f"block table {row.table} does not hold positions up to {end} in a pool of "
                                   f"{self.blocks} blocks of {size}")
            span = range(row.start, end)
            positions.extend(span)
            entries.extend(row.table[p // size] * size + p % size for p in span)
            count += row.length
            if row.logits:
                sampled.append(count - 1)
        if len(set(entries)) != len(entries):
            raise RuntimeError("two tokens of one step write the same KV entry (rows share a block they write)")
        self.positions = torch.tensor(positions, dtype=torch.long, device=device).unsqueeze(1)
        self.entries = torch.tensor(entries, dtype=torch.long, device=device)
        self._sampled = torch.tensor(sampled, dtype=torch.long, device=device)
        self.groups = _groups(rows, size, device)

    def last_token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Megatron's dynamic-batching hook: ``[1, T, h]`` → the ``[n, h]`` rows that sample."""
        assert self._sampled is not None, "begin_step names the rows before a forward"
        return hidden[0].index_select(0, self._sampled)


def _groups(rows: Sequence[PagedRow], size: int, device: torch.device | str) -> list[_Group]:
    """Consecutive single-token rows form one group; every longer row is a group of its own."""
    groups, i, offset = [], 0, 0
    while i < len(rows):
        j = i
        if rows[i].length == 1:
            while j < len(rows) and rows[j].length == 1:
                j += 1
            run = rows[i:j]
            lengths = [r.start + 1 for r in run]
            keys = max(lengths)
            width = -(-keys // size)
            tables = torch.tensor([list(r.table[:width]) + [0] * (width - min(width, len(r.table))) for r in run],
                                  dtype=torch.long, device=device)
            mask = (torch.arange(keys, device=device).unsqueeze(0)
                    >= torch.tensor(lengths, device=device).unsqueeze(1)).view(len(run), 1, 1, keys)
            groups.append(_Group(slice(offset, offset + len(run)), tables, keys, mask))
            offset += len(run)
        else:
            row, j = rows[i], i + 1
            keys = row.start + row.length
            tables = torch.tensor([list(row.table[: -(-keys // size)])], dtype=torch.long, device=device)
            groups.append(_Group(slice(offset, offset + row.length), tables, keys, None))
            offset += row.length
        i = j
    return groups


class PagedKVCache:
    """One layer's two pools ``[blocks, block_size, *shape]`` (K/V, or the latents c_k/c_v)."""

    def __init__(self, context: PagedContext, shapes: tuple[tuple[int, ...], tuple[int, ...]],
                 dtype: torch.dtype, device: torch.device | str) -> None:
        n, size = context.blocks, context.block_size
        self.a = torch.zeros(n, size, *shapes[0], dtype=dtype, device=device)
        self.b = torch.zeros(n, size, *shapes[1], dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def store(self, a: torch.Tensor, b: torch.Tensor, entries: torch.Tensor) -> None:
        """Write ``a, b [T, 1, ...]`` (the packed tokens) at their pool ``entries [T]``."""
        self.a.view(-1, *self.a.shape[2:])[entries] = a[:, 0].to(self.a.dtype)
        self.b.view(-1, *self.b.shape[2:])[entries] = b[:, 0].to(self.b.dtype)

    def read(self, group: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's rows' first ``group.keys`` entries: ``[keys, rows, ...]`` each."""
        rows = group.tables.shape[0]

        def gather(pool: torch.Tensor) -> torch.Tensor:
            return pool[group.tables].view(rows, -1, *pool.shape[2:])[:, : group.keys].transpose(0, 1)

        return gather(self.a), gather(self.b)


def _freqs_at(emb: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor | None:
    """Rotary angles ``[max_seq, 1, 1, d]`` at positions ``[s, b]`` → ``[s, b, 1, d]``."""
    return None if emb is None else emb[:, 0, 0][positions].unsqueeze(2)


def _cache(context: PagedContext, layer_number: int, shapes: tuple[tuple[int, ...], tuple[int, ...]],
           dtype: torch.dtype, device: torch.device | str) -> PagedKVCache:
    """Layer ``layer_number``'s pools in the context, allocated on the layer's first step."""
    cache = context.key_value_memory_dict.get(layer_number)
    if cache is None:
        cache = context.key_value_memory_dict[layer_number] = PagedKVCache(context, shapes, dtype, device)
    return cache


def _factored_cache(attn: Any, context: PagedContext, kind: CacheKind) -> PagedKVCache:
    """A decomposed block's pools: its heads' K/V, or its whole latents (the deinfer layout)."""
    if kind is CacheKind.LATENT:
        if not getattr(attn.linear_qkv_down, "full_latents", False):
            raise ValueError("the latent KV cache needs whole latents on every rank (the deinfer "
                             "layout); this layout keeps them split over ranks")
        ranks = attn.linear_qkv_down.section_ranks
        shapes: tuple = ((ranks[1],), (ranks[2],))
    else:
        shapes = ((attn.num_kv_heads, attn.head_dim),) * 2
    return _cache(context, attn.layer_number, shapes, attn.config.params_dtype, attn.linear_qkv_down.weight.device)


def _group_queries(group: _Group, query: torch.Tensor) -> torch.Tensor:
    """The group's queries: ``[s, 1, nq, d]`` for a chunk, ``[1, rows, nq, d]`` for single-token
    rows (the rows become the batch)."""
    q = query[group.tokens]
    return q.transpose(0, 1) if group.single else q


def _packed(group: _Group, out: torch.Tensor) -> torch.Tensor:
    """A group's attention output back in packed order: ``[s, 1, nq·d]``."""
    return out.transpose(0, 1) if group.single else out


def _attend_full(core: Any, group: _Group, query: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
    """One group over stored K/V: ``core`` takes ``(q, k, v, mask)`` as ``SdpaCoreAttention`` does."""
    stored_k, stored_v = cache.read(group)
    return _packed(group, core(_group_queries(group, query), stored_k, stored_v, group.mask))


def _attend_latent(attn: Any, group: _Group, query: torch.Tensor, cache: PagedKVCache,
                   k_emb: torch.Tensor | None, absorb: bool) -> torch.Tensor:
    """One group of a decomposed block over stored latents: K rebuilt (RoPE at each key's
    position); for single-token rows ``U_v`` absorbed after attention when ``absorb``."""
    q = _group_queries(group, query)
    stored_k, stored_v = cache.read(group)
    sq, rows = q.shape[:2]
    key = attn._rope(attn._project(attn.linear_k_up, stored_k, attn.num_kv_heads),
                     None if k_emb is None else k_emb[: group.keys])
    if absorb and group.single:  # P·(U_v C_v) = U_v·(P·C_v), exact
        latent_v = stored_v.unsqueeze(2).expand(-1, -1, attn.num_kv_heads, -1)
        z = attn.core_attention.attend(q, key, latent_v, group.mask)
        z = z.view(sq, rows, attn.num_kv_heads, -1, z.shape[-1])
        out = attn.linear_v_up.per_unit(z, attn.head_dim).reshape(sq, rows, -1)
    else:
        value = attn._project(attn.linear_v_up, stored_v, attn.num_kv_heads)
        out = attn.core_attention(q, key, value, group.mask)
    return _packed(group, out)


def _step_inputs(context: PagedContext, hidden_states: torch.Tensor, rotary_pos_emb: Any
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """What both paged forwards read first: the step's positions ``[T, 1]`` (``begin_step`` named
    the rows, which must be the forward's) and the rotary tables of queries and keys (None: none)."""
    assert context.positions is not None, "PagedContext.begin_step names the rows before a forward"
    assert hidden_states.shape[:2] == context.positions.shape, "the step's rows are those of the forward"
    if rotary_pos_emb is None:
        return context.positions, None, None
    q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
    return context.positions, q_emb, k_emb


def paged_attention(attn: Any, hidden_states: torch.Tensor, context: PagedContext,
                    rotary_pos_emb: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``FactoredSelfAttention.forward`` under a ``PagedContext``: ``[T, 1, h]`` → ``([T, 1, h], bias)``.

    Each token's K/V (or latents) go to its pool entry first; then every group reads its rows'
    blocks up to their own positions, which is causal attention over each sequence alone.
    """
    positions, q_emb, k_emb = _step_inputs(context, hidden_states, rotary_pos_emb)

    c_q, c_k, c_v = attn.linear_qkv_down(hidden_states)
    query = attn._rope(attn._project(attn.linear_q_up, c_q, attn.num_heads), _freqs_at(q_emb, positions))
    kind = context.kv_cache
    cache = _factored_cache(attn, context, kind)
    if kind is CacheKind.LATENT:
        cache.store(c_k, c_v, context.entries)
        parts = [_attend_latent(attn, g, query, cache, k_emb, context.absorb_values) for g in context.groups]
    else:
        key = attn._rope(attn._project(attn.linear_k_up, c_k, attn.num_kv_heads), _freqs_at(k_emb, positions))
        cache.store(key, attn._project(attn.linear_v_up, c_v, attn.num_kv_heads), context.entries)
        parts = [_attend_full(attn.core_attention, g, query, cache) for g in context.groups]
    return attn.linear_proj(parts[0] if len(parts) == 1 else torch.cat(parts))


def paged_dense_attention(attn: Any, hidden_states: torch.Tensor, context: PagedContext,
                          rotary_pos_emb: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Megatron's dense ``SelfAttention`` under a ``PagedContext`` (``layers.dense.PagedSelfAttention``):
    its own fused QKV projection and output projection, this rank's heads' K (after RoPE) and V in
    the pool — under either cache kind, as a dense block has no latents — and the same groups'
    attention as a decomposed block, over ``attn.paged_core`` (an ``SdpaCoreAttention`` of the
    rank's heads). ``[T, 1, h]`` → ``([T, 1, h], bias)``."""
    positions, q_emb, k_emb = _step_inputs(context, hidden_states, rotary_pos_emb)
    query, key, value = attn.get_query_key_value_tensors(hidden_states)
    if q_emb is not None:
        query = apply_rotary_pos_emb(query, _freqs_at(q_emb, positions), config=attn.config)
        key = apply_rotary_pos_emb(key, _freqs_at(k_emb, positions), config=attn.config)
    shape = (attn.num_query_groups_per_partition, attn.hidden_size_per_attention_head)
    cache = _cache(context, attn.layer_number, (shape, shape), attn.config.params_dtype, hidden_states.device)
    cache.store(key, value, context.entries)
    parts = [_attend_full(attn.paged_core, g, query, cache) for g in context.groups]
    return attn.linear_proj(parts[0] if len(parts) == 1 else torch.cat(parts))
