"""The KV pool's book alone (no model): its size under ``--kv-budget-gb``, admission by free
blocks, reference counts, the prefix cache and its eviction — against counts worked out by hand."""

from __future__ import annotations

import pytest

from deinfer_megatron.serving.blocks import BlockManager, block_keys, blocks_for, pool_blocks

GIB = 2**30


def test_the_budget_sizes_the_pool() -> None:
    # no budget: every one of --max-batch sequences at --max-seq-len (512 tokens = 32 blocks of 16)
    assert pool_blocks(block_size=16, bytes_per_token=1000, budget_gb=None, max_running=8, max_seq_len=512) == 8 * 32
    assert pool_blocks(block_size=16, bytes_per_token=1000, budget_gb=None, max_running=2, max_seq_len=500) == 2 * 32
    budget = 3 * 1000 * 512 / GIB  # what 3 slots of 512 tokens took: 96 blocks of 16 tokens
    assert pool_blocks(block_size=16, bytes_per_token=1000, budget_gb=budget, max_running=8, max_seq_len=512) == 96
    with pytest.raises(ValueError, match="holds no KV block of 16 tokens"):
        pool_blocks(block_size=16, bytes_per_token=1000, budget_gb=15999 / GIB, max_running=8, max_seq_len=512)


def test_admission_reserves_the_worst_case_and_blocks_come_as_positions_are_computed() -> None:
    pool = BlockManager(10, 4, prefix_caching=False)
    a = pool.admit([], 5, 5 + 10)  # 15 tokens: 4 blocks reserved, none taken yet
    assert a is not None and a.table == [] and a.reserved == 4
    assert pool.available == 6 and pool.in_use == 4
    pool.grow(a, 5)  # the prompt's 5 positions: 2 blocks
    assert len(a.table) == 2 and a.reserved == 2 and pool.available == 6
    b = pool.admit([], 20, 24)  # 6 blocks: exactly what is left
    assert b is not None and pool.available == 0
    assert pool.admit([], 1, 2) is None, "a full pool admits nothing (the request waits)"
    pool.release(a)  # finished early: its 2 taken and 2 reserved blocks come back
    assert pool.available == 4 and pool.in_use == 6
    pool.grow(b, 24)
    assert sorted(b.table) == sorted(set(b.table)) and len(b.table) == 6
    with pytest.raises(AssertionError, match="past the worst case"):
        pool.grow(b, 25)
    assert pool.fits(40) and not pool.fits(41)


def test_prefix_blocks_are_shared_and_the_written_block_never_is() -> None:
    pool = BlockManager(12, 4)
    system = list(range(100, 112))  # 12 tokens: 3 full blocks
    first = system + [1, 2]
    keys = block_keys(first, 4)
    assert len(keys) == 3 and keys == block_keys(system + [7], 4)  # a key depends on the prefix only
    a = pool.admit(keys, len(first), len(first) + 2)
    assert a is not None and a.cached == 0
    pool.grow(a, len(first))
    pool.register(a, first, len(first))  # the prompt is in the cache: its 3 full blocks are findable
    assert pool.cached == 3
    second = system + [9]
    b = pool.admit(block_keys(second, 4), len(second), len(second) + 3)
    assert b is not None and b.cached == 12 and b.table == a.table[:3], "the 3 system-prompt blocks are shared"
    # a prompt that is exactly the cached blocks: its last token is computed again, in a block of its own
    c = pool.admit(block_keys(system, 4), len(system), len(system) + 1)
    assert c is not None and c.cached == 8 and c.table == a.table[:2]
    pool.grow(c, len(system) + 1)
    assert c.table[2] not in a.table, "the block a sequence writes into is never shared"
    assert pool.queried_tokens == 14 + 13 + 12 and pool.hit_tokens == 12 + 8
    assert pool.hit_rate == pytest.approx(20 / 39)


def test_unused_cached_blocks_stay_findable_until_the_pool_needs_them() -> None:
    pool = BlockManager(4, 2)
    prompt = [5, 6, 7, 8, 9]  # 2 full blocks + 1
    a = pool.admit(block_keys(prompt, 2), 5, 6)
    pool.grow(a, 5)
    pool.register(a, prompt, 5)
    head = a.table[:2]
    pool.release(a)  # nobody uses them, but the 2 full blocks keep their keys
    assert pool.available == 4 and pool.cached == 2
    b = pool.admit(block_keys(prompt, 2), 5, 6)
    assert b.table == head and b.cached == 4, "found again after its sequence ended"
    pool.release(b)
    c = pool.admit([], 7, 7)  # 4 blocks: the 2 free ones first, then the cached ones, tail first
    pool.grow(c, 3)
    assert pool.cached == 2
    pool.grow(c, 5)
    assert c.table[2] == head[1] and pool.cached == 1, "the least recently used tail block goes first"
    pool.grow(c, 7)
    assert pool.cached == 0
    assert pool.admit(block_keys(prompt, 2), 5, 6) is None  # evicted, and no room left
    pool.release(c)
    d = pool.admit(block_keys(prompt, 2), 5, 6)
    assert d is not None and d.cached == 0, "evicted blocks are not found"


def test_a_disabled_prefix_cache_shares_nothing() -> None:
    pool = BlockManager(8, 2, prefix_caching=False)
    prompt = [1, 2, 3, 4, 5]
    a = pool.admit(block_keys(prompt, 2), 5, 5)
    pool.grow(a, 5)
    pool.register(a, prompt, 5)
    b = pool.admit(block_keys(prompt, 2), 5, 5)
    assert b.cached == 0 and pool.cached == 0 and blocks_for(5, 2) == 3
