"""KV-cache sizing: the bytes a generation really allocates equal the planner's bytes per token
(full and latent), and a memory budget sizes the slots or is refused with the GB needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
from deinfer_megatron.generation.context import slot_length
from tests.helpers.distributed import run_ranks
from tests.helpers.tiny_models import save_tiny_folder


def _allocated(model: str, kv: str) -> tuple[int, int]:
    from deinfer_megatron.generation.context import GenerationContext, describe
    from deinfer_megatron.generation.loop import generate_tokens
    from deinfer_megatron.generation.sampling import SamplingParams
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.planning.plan import make_plan
    from deinfer_megatron.specs.layout import Layout

    groups = init_parallel(1, 1)
    try:
        stage = load_folder(Path(model), Layout.DEINFER, groups)
        ctx = GenerationContext(2, 12, kv_cache=kv)
        generate_tokens(stage, [[1, 5, 9], [1, 7]], max_new_tokens=4, params=SamplingParams(), context=ctx)
        plan = make_plan(stage.arch, stage.rank_config, Layout.DEINFER)
        return describe(ctx)["kv_bytes_per_token"], plan.totals["kv_bytes_per_token"][kv]
    finally:
        shutdown()


def test_allocated_bytes_equal_the_plan(tmp_path: Path) -> None:
    save_tiny_folder("llama", tmp_path / "dense")
    model = run_decompose(DecomposeJob(tmp_path / "dense", "svd", ratio=0.3, layers="0-2", out=tmp_path / "dec"))
    full = run_ranks(1, _allocated, str(model), "full")[0]
    latent = run_ranks(1, _allocated, str(model), "latent")[0]
    assert full[0] == full[1] and latent[0] == latent[1]
    assert latent[0] < full[0], "at ratio 0.3 the latents are narrower than K and V"


def test_budget_sizes_slots_and_refuses_too_little() -> None:
    assert slot_length(100, max_positions=4096, bytes_per_token=1024, slots=2, budget_gb=None) == 100
    gb = 2**30
    assert slot_length(100, max_positions=4096, bytes_per_token=1024, slots=2, budget_gb=1024 * 2 * 500 / gb) == 500
    assert slot_length(100, max_positions=300, bytes_per_token=1024, slots=2, budget_gb=1.0) == 300
    with pytest.raises(ValueError, match=r"holds 50 tokens per request but 100 are needed .* raise --kv-budget-gb"):
        slot_length(100, max_positions=4096, bytes_per_token=1024, slots=2, budget_gb=1024 * 2 * 50 / gb)
    with pytest.raises(ValueError, match="exceeds the model's context of 64"):
        slot_length(100, max_positions=64, bytes_per_token=1, slots=1, budget_gb=None)
