"""Rank 0's book of the KV pool: which blocks each sequence owns, and the prefix cache.

Every rank holds the same pool of ``blocks`` blocks of ``block_size`` tokens per layer
(``layers.paged_cache``); only rank 0 decides who uses which block, here, and sends each step's
block tables with the step's plan. Nothing here touches a tensor.

- **Admission by free blocks.** A sequence is admitted only when its worst case (prompt +
  ``max_tokens``) fits in the blocks no one else has claimed: what it does not find in the prefix
  cache is *reserved* (a count), and taken from the pool block by block as its positions are
  computed (``grow``). Every admitted sequence can therefore always run to its end: nothing is
  preempted, and no sequence ever waits for another's blocks in the middle of its answer.
- **Prefix caching.** A block whose ``block_size`` tokens are all in the cache gets a key: a
  digest of the previous block's key and its own token ids, so equal keys mean equal prefixes
  from position 0. A new prompt walks its full blocks through the key table and shares every
  block found (reference counts). Shared blocks are only read: the prompt's last token is always
  computed again, so the block a sequence writes into is never shared (the "recompute" way of a
  shared partial last block; no copy-on-write is needed). A block nobody uses any more keeps its
  key and stays findable until the pool needs it (least recently used first, and a sequence's
  last blocks before its first ones).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

DEFAULT_BLOCK_SIZE = 16  # tokens per block (docs/SERVING.md, "Block size")


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


def block_keys(tokens: Sequence[int], block_size: int, count: int | None = None) -> list[bytes]:
    """The keys of the first ``count`` full blocks of ``tokens`` (all of them by default): each
    a digest of the previous key and the block's token ids."""
    full = len(tokens) // block_size if count is None else min(count, len(tokens) // block_size)
    keys, previous = [], b""
    for k in range(full):
        chunk = array("q", tokens[k * block_size : (k + 1) * block_size]).tobytes()
        previous = hashlib.blake2b(previous + chunk, digest_size=16).digest()
        keys.append(previous)
    return keys


@dataclass
class SeqBlocks:
    """One sequence's blocks: ``table`` (position p in block ``table[p // block_size]``), the
    blocks still ``reserved`` for it, the keys of its leading full blocks, and the prompt tokens
    it found in the prefix cache (``cached``)."""

    table: list[int] = field(default_factory=list)
    reserved: int = 0
    keys: list[bytes] = field(default_factory=list)
    cached: int = 0


class BlockManager:
    """The pool's blocks: free, in use (reference counts), or cached and evictable.

    Args:
        blocks: blocks in the pool.
        block_size: tokens per block.
        prefix_caching: share full prompt blocks between sequences.
    """

    def __init__(self, blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        if blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of one token, got {blocks} × {block_size}")
        self.blocks, self.block_size, self.prefix_caching = blocks, block_size, prefix_caching
        self._refs = [0] * blocks
        self._key: list[bytes | None] = [None] * blocks
        self._table: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused; least recent first
        self._reserved = 0
        self.queried_tokens = 0  # prompt tokens of admitted sequences
        self.hit_tokens = 0  # of which found in the prefix cache

    # ---------------------------------------------------------------- what is left
    @property
    def available(self) -> int:
        """Blocks a new sequence may still claim."""
        return len(self._free) + len(self._evictable) - self._reserved

    @property
    def in_use(self) -> int:
        """Blocks some sequence holds or has reserved."""
        return self.blocks - len(self._free) - len(self._evictable) + self._reserved

    @property
    def cached(self) -> int:
        """Blocks findable in the prefix cache (in use or not)."""
        return len(self._table)

    def fits(self, tokens: int) -> bool:
        """Whether a sequence of ``tokens`` tokens could ever fit in the pool."""
        return blocks_for(tokens, self.block_size) <= self.blocks

    # ---------------------------------------------------------------- admission and growth
    def _hits(self, keys: list[bytes], prompt_len: int) -> list[int]:
        """Cached blocks of the prompt's leading full blocks, stopping at the first miss; never
        the block of the prompt's last token (it is computed again for its logits)."""
        if not self.prefix_caching:
            return []
        found = []
        for key in keys[: (prompt_len - 1) // self.block_size]:
            block = self._table.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def admit(self, keys: list[bytes], prompt_len: int, worst_tokens: int) -> SeqBlocks | None:
        """Claim the cached blocks of a prompt (``keys``: ``block_keys`` of it) and reserve the
        rest of ``worst_tokens``; None (nothing claimed) when the pool cannot promise them."""
        hits = self._hits(keys, prompt_len)
        need = blocks_for(worst_tokens, self.block_size) - len(hits)
        revived = sum(1 for b in hits if self._refs[b] == 0)
        if need + revived > self.available:
            return None
        for b in hits:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        self._reserved += need
        cached = len(hits) * self.block_size
        self.queried_tokens += prompt_len
        self.hit_tokens += cached
        return SeqBlocks(table=hits, reserved=need, keys=list(keys[: len(hits)]), cached=cached)

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)  # the least recently used cached block
            del self._table[self._key[block]]  # type: ignore[index]
            self._key[block] = None
        self._refs[block] = 1
        return block

    def grow(self, seq: SeqBlocks, tokens: int) -> None:
        """Give ``seq`` blocks up to position ``tokens - 1`` from its reservation."""
        while len(seq.table) * self.block_size < tokens:
            assert seq.reserved > 0, "a sequence grew past the worst case it was admitted with"
            seq.reserved -= 1
            self._reserved -= 1
            seq.table.append(self._take())

    def register(self, seq: SeqBlocks, tokens: Sequence[int], computed: int) -> None:
        """Make ``seq``'s full blocks among its first ``computed`` positions (``tokens``: its
        prompt and generated ids) findable by later prompts."""
        if not self.prefix_caching:
            return
        full = computed // self.block_size
        if full <= len(seq.keys):
            return
        previous = seq.keys[-1] if seq.keys else b""
        for k in range(len(seq.keys), full):
            chunk = array("q", tokens[k * self.block_size : (k + 1) * self.block_size]).tobytes()
            previous = hashlib.blake2b(previous + chunk, digest_size=16).digest()
            seq.keys.append(previous)
            block = seq.table[k]
            if previous not in self._table and self._key[block] is None:
                self._table[previous] = block
                self._key[block] = previous

    def release(self, seq: SeqBlocks) -> None:
        """``seq`` is done: its blocks go back (cached ones stay findable) with its reservation."""
        for block in reversed(seq.table):  # the tail is evicted before the shared head
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._key[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        self._reserved -= seq.reserved
        seq.table, seq.reserved = [], 0

    @property
    def hit_rate(self) -> float:
        """Share of admitted prompt tokens found in the prefix cache."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def pool_blocks(*, block_size: int, bytes_per_token: int, budget_gb: float | None, max_running: int,
                max_seq_len: int) -> int:
    """Blocks in one rank's pool: what ``budget_gb`` holds, else enough for ``max_running``
    sequences of ``max_seq_len`` tokens each; a budget that holds no block is a one-line error."""
    if budget_gb is None:
        return max_running * blocks_for(max_seq_len, block_size)
    block_bytes = max(1, bytes_per_token * block_size)
    fits = int(budget_gb * 2**30) // block_bytes
    if fits < 1:
        raise ValueError(f"--kv-budget-gb {budget_gb:g} holds no KV block of {block_size} tokens "
                         f"({block_bytes / 2**30:.3g} GB each); raise --kv-budget-gb or lower --block-size")
    return fits
