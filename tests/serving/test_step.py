"""Continuous batching on the model: requests that join at different steps, share a few KV
slots, feed their prompts in chunks beside running decodes, and each still produce what Hugging
Face ``generate`` produces for it alone (greedy), for both KV caches, RoPE (LLaMA) and learned
positions (OPT). A seeded sampled request draws what ``generate``'s own loop draws for it alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.tiny_models import full_rank_folders

PROMPTS = [[1, 504, 3458], [1, 9519, 12, 2834, 77, 901, 33, 4, 18], [1, 378, 1345, 30, 1096],
           [1, 22, 9, 3215, 281, 17, 5], [1, 45, 600, 2], [1, 7, 7, 810, 3000, 12, 99, 41]]
MAX_NEW = [6, 3, 8, 4, 7, 5]
SLOTS, CHUNK = 3, 4


def ids_text(ids: list[int]) -> str:
    return "".join(f"{i}," for i in ids)


def drive(stage: Any, kind: str, absorb: bool, sampled: Any = None) -> tuple[list[list[int]], bool]:
    """Request i arrives at step 2·i; every request's generated ids, and whether a step both
    decoded and prefilled."""
    from deinfer_megatron.generation.sampling import SamplingParams
    from deinfer_megatron.layers.slot_cache import SlotContext
    from deinfer_megatron.serving.scheduler import Request, Scheduler
    from deinfer_megatron.serving.step import StepRunner

    runner = StepRunner(stage, SlotContext(SLOTS, 32, kv_cache=kind, absorb_values=absorb))
    scheduler = Scheduler(slots=SLOTS, tokens_per_slot=32, max_queue=16, decode=ids_text,
                          eos_ids=frozenset(), prefill_chunk=CHUNK)
    texts = [""] * len(PROMPTS)
    requests = [Request(prompt=p, max_tokens=m, sampling=[sampled or SamplingParams()],
                        sink=lambda e, i=i: texts.__setitem__(i, texts[i] + e.text))
                for i, (p, m) in enumerate(zip(PROMPTS, MAX_NEW))]
    step, mixed = 0, False
    while step < 2 * len(requests) or not scheduler.idle():
        if step % 2 == 0 and step // 2 < len(requests):
            scheduler.submit(requests[step // 2])
        plan = scheduler.next_plan()
        mixed |= bool(plan.decode) and plan.prefill is not None
        scheduler.complete(plan, runner.run(plan))
        step += 1
    return [[int(t) for t in text.split(",")[:-1]] for text in texts], mixed


def step_worker(folders: dict[str, str]) -> dict[str, Any]:
    from deinfer_megatron.generation.context import GenerationContext
    from deinfer_megatron.generation.loop import generate_tokens
    from deinfer_megatron.generation.sampling import SamplingParams
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.specs.layout import Layout

    groups = init_parallel(1, 1)
    out: dict[str, Any] = {}
    try:
        for family, folder in folders.items():
            stage = load_folder(Path(folder), Layout.DEINFER, groups)
            for kind, absorb in (("full", True), ("latent", True), ("latent", False)):
                out[f"{family}/{kind}/{absorb}"] = drive(stage, kind, absorb)
            sampled = SamplingParams(greedy=False, temperature=0.9, top_k=50, seed=11)
            out[f"{family}/sampled"] = drive(stage, "full", True, sampled)[0]
            out[f"{family}/sampled-alone"] = [
                generate_tokens(stage, [p], max_new_tokens=m, params=sampled,
                                context=GenerationContext(1, len(p) + m))[0][0].token_ids
                for p, m in zip(PROMPTS, MAX_NEW)]
    finally:
        shutdown()
    return out


def test_requests_joining_at_any_step_equal_generation_alone(tmp_path) -> None:
    folders, expected = {}, {}
    for family in ("llama", "opt"):
        hf, _, dec = full_rank_folders(tmp_path / family, family)
        folders[family] = str(dec)
        expected[family] = []
        for p, m in zip(PROMPTS, MAX_NEW):
            with torch.no_grad():
                gen = hf.generate(torch.tensor([p]), max_new_tokens=m, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
            expected[family].append(gen[0, len(p):].tolist())
    results = run_ranks(1, step_worker, folders)[0]
    for family in folders:
        for kind in ("full/True", "latent/True", "latent/False"):
            tokens, mixed = results[f"{family}/{kind}"]
            assert tokens == expected[family], f"{family}/{kind}"
            assert mixed, "some step decoded running requests while it prefilled a new one"
        assert results[f"{family}/sampled"] == results[f"{family}/sampled-alone"], family
        assert results[f"{family}/sampled"] != expected[family], "sampling did sample"
