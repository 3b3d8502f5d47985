"""The inference context of one generation: Megatron's static-batching context plus which KV
cache the decomposed layers keep, and how large it may be."""

from __future__ import annotations

from typing import Any

from megatron.core.inference.contexts.static_context import StaticInferenceContext

from deinfer_megatron.layers.kv_cache import CacheKind


class GenerationContext(StaticInferenceContext):
    """``StaticInferenceContext`` with the KV-cache choice read by decomposed attention.

    Args:
        max_batch_size: request slots.
        max_sequence_length: tokens per slot (prompt + new tokens).
        kv_cache: ``CacheKind.FULL`` (K/V of each rank's heads) or ``LATENT`` (rank-r latents);
            a name is parsed by ``CacheKind.parse``, the one place an unknown kind is refused.
        absorb_values: with the latent cache, fold ``U_v`` in after attention when decoding.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int, *,
                 kv_cache: CacheKind = CacheKind.FULL, absorb_values: bool = True) -> None:
        super().__init__(max_batch_size, max_sequence_length)
        self.kv_cache = CacheKind.parse(kv_cache)
        self.absorb_values = absorb_values

    def cache_bytes(self) -> int:
        """Bytes this rank holds in KV caches (decomposed layers' and Megatron's dense ones)."""
        total = 0
        for entry in self.key_value_memory_dict.values():
            total += entry.nbytes if hasattr(entry, "nbytes") else sum(t.nbytes for t in entry)
        return total


def slot_length(needed: int, *, max_positions: int, bytes_per_token: int, slots: int,
                budget_gb: float | None) -> int:
    """Tokens preallocated per request slot: what the request needs, or as many as the budget
    allows (never more than the model's context); too small a budget is a clear error."""
    if needed > max_positions:
        raise ValueError(
            f"prompt + new tokens = {needed} exceeds the model's context of {max_positions} tokens; "
            "shorten the prompt or lower --max-new-tokens"
        )
    if budget_gb is None:
        return needed
    fits = int(budget_gb * 2**30) // max(1, bytes_per_token * slots)
    if fits < needed:
        need_gb = needed * bytes_per_token * slots / 2**30
        raise ValueError(
            f"--kv-budget-gb {budget_gb:g} holds {fits} tokens per request but {needed} are needed "
            f"({need_gb:.3g} GB for {slots} requests); raise --kv-budget-gb"
        )
    return min(fits, max_positions)


def describe(context: Any) -> dict[str, Any]:
    """What a context allocated: bytes held, bytes per token slot, slots and tokens per slot."""
    slots = context.max_batch_size * context.max_sequence_length
    nbytes = context.cache_bytes()
    return {"kv_cache_bytes": nbytes, "kv_bytes_per_token": nbytes // max(1, slots),
            "slots": context.max_batch_size, "tokens_per_slot": context.max_sequence_length}
