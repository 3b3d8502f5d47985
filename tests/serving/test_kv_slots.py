"""How many KV slots a server holds: ``--max-batch``, or what ``--kv-budget-gb`` holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from deinfer_megatron.generation.options import CacheOptions
from deinfer_megatron.serving.server import ServeJob, kv_slots


def test_budget_bounds_the_slots() -> None:
    job = ServeJob(model=Path("m"), max_batch=8)
    assert kv_slots(job, bytes_per_token=1000, tokens_per_slot=512) == 8  # no budget: --max-batch
    gib = 2**30
    budget = ServeJob(model=Path("m"), max_batch=8, cache=CacheOptions(budget_gb=3 * 1000 * 512 / gib))
    assert kv_slots(budget, bytes_per_token=1000, tokens_per_slot=512) == 3  # 3 slots of 512 tokens fit
    roomy = ServeJob(model=Path("m"), max_batch=8, cache=CacheOptions(budget_gb=1.0))
    assert kv_slots(roomy, bytes_per_token=1000, tokens_per_slot=512) == 8  # never more than --max-batch
    tiny = ServeJob(model=Path("m"), cache=CacheOptions(budget_gb=1000 * 511 / gib))
    with pytest.raises(ValueError, match="holds no slot of 512 tokens"):
        kv_slots(tiny, bytes_per_token=1000, tokens_per_slot=512)
