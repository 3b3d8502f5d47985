"""The paged KV pool alone: a step's tokens are written at the entries their block tables name
and every attention group reads its rows' own blocks, worked out by hand (the model-level check
— requests joining at any step equal generation alone — is tests/serving/test_step.py)."""

from __future__ import annotations

import pytest
import torch

from deinfer_megatron.layers.paged_cache import PagedContext, PagedKVCache, PagedRow

CPU = torch.device("cpu")


def test_a_step_packs_its_rows_and_groups_the_single_token_ones() -> None:
    context = PagedContext(6, 4, 24)
    rows = [PagedRow(5, 1, (3, 0)), PagedRow(2, 1, (4,)), PagedRow(0, 3, (1,), logits=False), PagedRow(7, 2, (2, 5, 0))]
    context.begin_step(rows, CPU)
    assert context.positions.flatten().tolist() == [5, 2, 0, 1, 2, 7, 8]
    # position p of a row is entry table[p // 4] * 4 + p % 4 of the pool
    assert context.entries.tolist() == [0 * 4 + 1, 4 * 4 + 2, 4, 5, 6, 5 * 4 + 3, 0 * 4 + 0]
    hidden = torch.arange(7.0).view(1, 7, 1)
    assert context.last_token_logits(hidden).flatten().tolist() == [0.0, 1.0, 6.0]  # the rows that sample
    single, prefill, chunk = context.groups
    assert (single.tokens, prefill.tokens, chunk.tokens) == (slice(0, 2), slice(2, 5), slice(5, 7))
    assert single.keys == 6 and single.tables.tolist() == [[3, 0], [4, 0]]  # padded to the longest row
    assert single.mask.flatten(1).tolist() == [[False] * 6, [False] * 3 + [True] * 3]
    assert prefill.mask is None and prefill.keys == 3 and prefill.tables.tolist() == [[1]]
    assert chunk.keys == 9 and chunk.tables.tolist() == [[2, 5, 0]]
    assert not context.is_decode_only() and not context.is_static_batching()


def test_tokens_land_in_their_blocks_and_groups_read_their_own() -> None:
    context = PagedContext(4, 2, 8)
    cache = PagedKVCache(context, ((3,), (1,)), torch.float32, CPU)
    context.begin_step([PagedRow(0, 3, (2, 0)), PagedRow(0, 1, (3,))], CPU)
    a = torch.arange(12.0).view(4, 1, 3)
    b = torch.arange(4.0).view(4, 1, 1) + 100
    cache.store(a, b, context.entries)
    assert torch.equal(cache.a[2], a[:2, 0]) and torch.equal(cache.a[0, 0], a[2, 0])
    assert torch.equal(cache.a[3, 0], a[3, 0]) and cache.a[1].abs().sum() == 0 and cache.a[0, 1].abs().sum() == 0
    first, second = context.groups
    read_a, read_b = cache.read(first)  # [keys, rows, ...]
    assert read_a.shape == (3, 1, 3) and torch.equal(read_a[:, 0], a[:3, 0]) and torch.equal(read_b[:, 0], b[:3, 0])
    read_a, _ = cache.read(second)
    assert read_a.shape == (1, 1, 3) and torch.equal(read_a[0, 0], a[3, 0])
    assert cache.nbytes == 4 * 2 * (3 + 1) * 4


def test_a_step_that_cannot_be_stored_is_refused() -> None:
    context = PagedContext(4, 2, 8)
    with pytest.raises(RuntimeError, match="does not hold positions up to 3"):
        context.begin_step([PagedRow(0, 3, (1,))], CPU)
    with pytest.raises(RuntimeError, match="lies outside 0..8"):
        context.begin_step([PagedRow(7, 2, (0, 1, 2, 3, 0))], CPU)
    with pytest.raises(RuntimeError, match="does not hold positions"):
        context.begin_step([PagedRow(0, 1, (4,))], CPU)  # no block 4 in a pool of 4
    with pytest.raises(RuntimeError, match="write the same KV entry"):
        context.begin_step([PagedRow(1, 1, (2,)), PagedRow(1, 1, (2,))], CPU)
    with pytest.raises(ValueError, match="at least one block"):
        PagedContext(0, 16, 8)
