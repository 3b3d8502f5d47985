"""What a generation job caches: the KV cache's kind and size, parsed once where it enters.

Where the job runs, its precision and engine are the runtime's (``runtime.options``); the KV
cache kind is a ``CacheKind`` (the only place an unknown cache name is refused is
``CacheKind.parse``). The JSON a job reports keeps the plain names (``.value``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deinfer_megatron.layers.kv_cache import CacheKind


@dataclass(frozen=True)
class CacheOptions:
    """Which KV cache the decomposed layers keep, and how large it may be.

    Args:
        kind: full K/V of each rank's heads, or the rank-r latents (parsed by ``CacheKind.parse``).
        absorb_values: with the latent cache, fold ``U_v`` in after attention when decoding.
        budget_gb: KV-cache memory per rank that sizes the slots; None: what the request needs.
    """

    kind: CacheKind = CacheKind.FULL
    absorb_values: bool = True
    budget_gb: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CacheKind.parse(self.kind))

    def check_budget(self) -> None:
        """A budget must be a positive number of GB (NaN and infinity included in the refusal)."""
        if self.budget_gb is not None and not (math.isfinite(self.budget_gb) and self.budget_gb > 0):
            raise ValueError(f"--kv-budget-gb must be a number of GB > 0, got {self.budget_gb}")
