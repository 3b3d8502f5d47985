"""The correctness contract on CUDA: NCCL ranks, models built on the GPU, no CPU shims.

Run by ``scripts/gpu_check.sh`` on a GPU machine; skipped (with the reason) where
``torch.cuda.is_available()`` is False. Every layout of tiny LLaMA and Qwen2 models with random
variadic factors (layer 1 dense) gives, at TP=1 (and TP=2 where two GPUs exist), the logits
of the single-process Hugging Face reference run on the CPU — float32, within DESIGN.md §5's
tolerance — with every parameter on the rank's own GPU; and greedy generation with the
project's loop and Megatron's static engine gives the reference's tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deinfer_megatron.specs.layout import Layout
from tests.helpers.distributed import run_ranks
from tests.helpers.tiny_models import decompose_randomly, mixed_ranks, random_hf_model

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

FAMILIES = ("llama", "qwen2")
LAYOUTS = ("deinfer", "naive", "dense")
TOL = 1e-4
PROMPTS = [[5, 17, 42, 8, 99, 3], [11, 2, 64, 30]]
MAX_NEW = 6


def _case(family: str):
    """(Hugging Face reference with U·V multiplied in, decomposed state dict, arch, rank config)."""
    from deinfer_megatron.arch.model import arch_from_hf_config
    from deinfer_megatron.specs.rank_config import RankConfig

    hf = random_hf_model(family)
    ranks = mixed_ranks(hf, [0, 2, 3])
    state = decompose_randomly(hf, ranks)
    arch = arch_from_hf_config(hf.config.to_dict())
    return hf, state, arch, RankConfig.from_mapping(ranks, arch)


def _where_and_who() -> dict[str, Any]:
    import torch.distributed as dist

    return {"backend": dist.get_backend(), "device": str(torch.cuda.current_device())}


def parity_worker(tp: int) -> dict[str, Any]:
    """Rank body: every family × layout at TP=``tp`` on this rank's GPU."""
    from deinfer_megatron.models.build import build_stage, load_weights
    from deinfer_megatron.models.pipeline import stage_forward
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown

    groups = init_parallel(tp, 1)
    out: dict[str, Any] = {"job": _where_and_who(), "groups_device": str(groups.device), "results": {}}
    try:
        ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(7))
        pos = torch.arange(13).unsqueeze(0).expand(2, -1)
        for family in FAMILIES:
            hf, state, arch, rank_config = _case(family)
            with torch.no_grad():
                ref = hf(ids).logits
            for layout in LAYOUTS:
                stage = build_stage(arch, rank_config, Layout(layout), groups)
                load_weights(stage, state, rank_config)
                logits = stage_forward(stage, ids, pos)
                out["results"][f"{family}/{layout}"] = {
                    "param_devices": sorted({str(p.device) for p in stage.model.parameters()}),
                    "logits_device": str(logits.device),
                    "max_abs_diff": (logits.float().cpu() - ref).abs().max().item(),
                    "logit_scale": ref.abs().max().item(),
                    "greedy_equal": bool((logits.argmax(-1).cpu() == ref.argmax(-1)).all()),
                }
    finally:
        shutdown()
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_layout_parity_on_cuda(tp: int) -> None:
    if tp > GPUS:
        pytest.skip(f"TP={tp} needs {tp} GPUs; this machine has {GPUS}")
    for rank, got in enumerate(run_ranks(tp, parity_worker, tp, timeout=240)):
        assert got["job"] == {"backend": "nccl", "device": str(rank)}, got["job"]
        assert got["groups_device"] == f"cuda:{rank}"
        assert set(got["results"]) == {f"{f}/{l}" for f in FAMILIES for l in LAYOUTS}
        for key, r in got["results"].items():
            assert r["param_devices"] == [f"cuda:{rank}"] and r["logits_device"] == f"cuda:{rank}", key
            assert r["max_abs_diff"] <= TOL * max(1.0, r["logit_scale"]), (key, r)
            assert r["greedy_equal"], key


def generation_worker(layouts: tuple[str, ...]) -> dict[str, Any]:
    """Rank body: greedy tokens of the LLaMA case with the project's loop and Megatron's engine."""
    from deinfer_megatron.generation.context import GenerationContext
    from deinfer_megatron.generation.loop import generate_tokens
    from deinfer_megatron.generation.megatron_engine import generate_with_engine
    from deinfer_megatron.generation.sampling import SamplingParams
    from deinfer_megatron.models.build import build_stage, load_weights
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown

    groups = init_parallel(1, 1)
    out = {}
    try:
        _, state, arch, rank_config = _case("llama")
        for layout in layouts:
            stage = build_stage(arch, rank_config, Layout(layout), groups)
            load_weights(stage, state, rank_config)
            for driver, run in (("loop", generate_tokens), ("engine", generate_with_engine)):
                context = GenerationContext(len(PROMPTS), max(map(len, PROMPTS)) + MAX_NEW)
                outs, _ = run(stage, PROMPTS, max_new_tokens=MAX_NEW, params=SamplingParams(), context=context)
                out[f"{layout}/{driver}"] = [o.token_ids for o in outs]
    finally:
        shutdown()
    return out


def test_greedy_generation_on_cuda() -> None:
    hf, _, _, _ = _case("llama")
    expected = []
    for p in PROMPTS:
        with torch.no_grad():
            gen = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        expected.append(gen[0, len(p):].tolist())
    got = run_ranks(1, generation_worker, ("deinfer", "dense"), timeout=240)[0]
    assert set(got) == {f"{l}/{d}" for l in ("deinfer", "dense") for d in ("loop", "engine")}
    for key, tokens in got.items():
        assert tokens == expected, key
