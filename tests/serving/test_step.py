"""Continuous batching on the model, through the paged KV cache: requests that join at
different steps, share few blocks, prefill together and beside running decodes, share prompt
prefixes, and wait for blocks in a full pool — each still produces what Hugging Face ``generate``
produces for it alone (greedy) and what the project's unpaged loop produces, for both KV caches,
RoPE (LLaMA) and learned positions (OPT), at TP=1, TP=3 and PP=2. Attention blocks the model
keeps dense (Megatron's, ``PagedSelfAttention``: a decomposed model whose allocation left layer
0's attention dense, under both caches, and the dense layout) page their K/V alike at TP=1 and
TP=3. A seeded sampled request draws what ``generate``'s own loop draws for it alone. In bfloat16 (``serve --dtype bfloat16``, TP=1,
both caches) the pool is bfloat16 and requests joining at different steps produce what
transformers in bfloat16 produces for them, on prompts whose greedy steps bfloat16 rounding
cannot flip (``tests.helpers.bf16``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from tests.helpers.bf16 import TOLERANCE, bf16_error, decided
from tests.helpers.distributed import run_ranks
from tests.helpers.serving import drive_steps
from tests.helpers.tiny_models import full_rank_folders

PROMPTS = [[1, 504, 3458], [1, 9519, 12, 2834, 77, 901, 33, 4, 18], [1, 378, 1345, 30, 1096],
           [1, 22, 9, 3215, 281, 17, 5], [1, 45, 600, 2], [1, 7, 7, 810, 3000, 12, 99, 41]]
MAX_NEW = [6, 3, 8, 4, 7, 5]
SYSTEM = [1, 3, 14, 15, 92, 65, 35, 89, 79]  # a shared "system prompt": 2 full blocks of 4, and one token
SHARED = [SYSTEM + [7, 8], SYSTEM + [7, 8], SYSTEM[:8], SYSTEM + [44, 3, 2, 9, 8], SYSTEM + [7], SYSTEM[:5]]
SHARED_NEW = [5, 4, 6, 3, 5, 4]
HEADS9 = dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, intermediate_size=96,
              num_hidden_layers=2, max_position_embeddings=256)

# name: (prompts, new tokens, arrival steps, drive_steps options)
CASES = {
    "joining": (PROMPTS, MAX_NEW, [0, 2, 4, 6, 8, 10], {}),  # 3 running at most, chunks of 4 beside decodes
    "shared": (SHARED, SHARED_NEW, [0, 6, 6, 7, 12, 13], {}),  # later prompts find the first one's blocks
    "full-pool": (SHARED + PROMPTS, SHARED_NEW + MAX_NEW, [0] * 12,  # room for 2 at a time: the rest wait,
                  dict(blocks=10, chunk=16)),  # and cached blocks are evicted for them
}
JOINING = {"joining": CASES["joining"]}  # the case the rarer variants run
BF16_NEW = 6  # new tokens of each bfloat16 request


def greedy_alone(hf: Any, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    out = []
    for p, m in zip(prompts, max_new):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([p]), max_new_tokens=m, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def check_case(name: str, driven: Any, expected: list[list[int]]) -> None:
    assert driven.tokens == expected, name
    if name == "joining":
        assert driven.mixed, "some step decoded running requests while it prefilled a new one"
    if name == "shared":
        assert driven.hit_tokens >= 4 * 4, "the system prompt's blocks were found again"
        assert driven.batched_prefill, "two arriving prompts were prefilled in one step"
    if name == "full-pool":
        assert driven.waited and driven.evicted, "requests waited for blocks, and cached blocks were reused"


def step_worker(folders: dict[str, str], mixed: str, bf16_prompts: list[list[int]]) -> dict[str, Any]:
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
            for kind, absorb, cases in (("full", True, CASES), ("latent", True, CASES), ("latent", False, JOINING)):
                for case in cases:
                    prompts, new, arrive, options = CASES[case]
                    out[f"{family}/{kind}/{absorb}/{case}"] = drive_steps(stage, prompts, new, arrive, kind=kind,
                                                                          absorb=absorb, **options)
            out[f"{family}/unpaged"] = [
                generate_tokens(stage, [p], max_new_tokens=m, params=SamplingParams(),
                                context=GenerationContext(1, len(p) + m))[0][0].token_ids
                for prompts, new, _, _ in CASES.values() for p, m in zip(prompts, new)]
            sampled = SamplingParams(greedy=False, temperature=0.9, top_k=50, seed=11)
            out[f"{family}/sampled"] = drive_steps(stage, PROMPTS, MAX_NEW, CASES["joining"][2],
                                                   sampled=sampled).tokens
            out[f"{family}/sampled-alone"] = [
                generate_tokens(stage, [p], max_new_tokens=m, params=sampled,
                                context=GenerationContext(1, len(p) + m))[0][0].token_ids
                for p, m in zip(PROMPTS, MAX_NEW)]
        for layout, folder, kinds, cases in ((Layout.DEINFER, mixed, ("full", "latent"), CASES),
                                             (Layout.DENSE, folders["llama"], ("full",), JOINING)):
            stage = load_folder(Path(folder), layout, groups)
            for kind in kinds:
                for case in cases:
                    prompts, new, arrive, options = CASES[case]
                    out[f"dense-kept/{layout.value}/{kind}/{case}"] = drive_steps(stage, prompts, new, arrive,
                                                                                  kind=kind, **options)
        stage = load_folder(Path(folders["llama"]), Layout.DEINFER, groups, dtype=torch.bfloat16)
        for kind in ("full", "latent"):  # three requests joining at steps 0, 2 and 3, chunks of 4 beside decodes
            out[f"bf16/{kind}"] = drive_steps(stage, bf16_prompts, [BF16_NEW] * len(bf16_prompts),
                                              [0, 2, 3][: len(bf16_prompts)], kind=kind)
    finally:
        shutdown()
    return out



def test_requests_joining_at_any_step_equal_generation_alone(tmp_path) -> None:
    folders, expected = {}, {}
    for family in ("llama", "opt"):
        hf, _, dec = full_rank_folders(tmp_path / family, family)
        folders[family] = str(dec)
        expected[family] = {case: greedy_alone(hf, prompts, new) for case, (prompts, new, _, _) in CASES.items()}
        if family == "llama":
            hf16 = copy.deepcopy(hf).to(torch.bfloat16)  # as transformers loads the float32 folder in bfloat16
            bf16 = decided(hf16, TOLERANCE * bf16_error(hf, hf16), new=BF16_NEW)
    _, _, mixed = full_rank_folders(tmp_path / "mixed", "llama", dense_attention=(0,))  # the same weights as "llama"
    results = run_ranks(1, step_worker, folders, str(mixed), bf16[:, :-BF16_NEW].tolist())[0]
    kept = {key: results.pop(key) for key in list(results) if key.startswith("dense-kept/")}
    assert len(kept) == 7
    for key, driven in kept.items():
        check_case(key, driven, expected["llama"][key.rsplit("/", 1)[1]])
    for kind in ("full", "latent"):
        driven = results.pop(f"bf16/{kind}")
        assert driven.pool_dtypes == {"torch.bfloat16"}, kind
        assert driven.mixed and driven.tokens == bf16[:, -BF16_NEW:].tolist(), f"bf16/{kind}"
    for family in folders:
        for kind, cases in (("full/True", CASES), ("latent/True", CASES), ("latent/False", JOINING)):
            for case in cases:
                check_case(f"{family}/{kind}/{case}", results[f"{family}/{kind}/{case}"], expected[family][case])
        flat = [t for case in CASES for t in expected[family][case]]
        assert results[f"{family}/unpaged"] == flat, f"{family}: the unpaged loop alone"
        assert results[f"{family}/sampled"] == results[f"{family}/sampled-alone"], family
        assert results[f"{family}/sampled"] != expected[family]["joining"], "sampling did sample"


def tp3_worker(folder: str, mixed: str) -> dict[str, Any] | None:
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.specs.layout import Layout

    groups = init_parallel(3, 1)
    lead = groups.global_rank == 0
    out: dict[str, Any] = {}
    try:
        for name, path, layout, kinds, cases in (
                ("deinfer", folder, Layout.DEINFER, ("full", "latent"), CASES),
                ("naive", folder, Layout.NAIVE, ("full",), JOINING),
                ("dense", folder, Layout.DENSE, ("full",), JOINING),  # Megatron's attention, a KV head per rank
                ("dense-kept", mixed, Layout.DEINFER, ("full", "latent"), JOINING)):
            stage = load_folder(Path(path), layout, groups)
            for kind in kinds:
                for case in cases:
                    prompts, new, arrive, options = CASES[case]
                    out[f"{name}/{kind}/{case}"] = drive_steps(stage, prompts, new, arrive, kind=kind, **options)
    finally:
        shutdown()
    return out if lead else None


def test_tp3_paged_steps_equal_generation_alone(tmp_path) -> None:
    """9 heads / 3 KV heads split over 3 ranks: one head group per rank (DeInfer, and Megatron's
    dense attention), or every head on every rank (naive); the plan goes from rank 0 to the others
    each step, as in the server."""
    hf, _, dec = full_rank_folders(tmp_path / "dec", **HEADS9)
    _, _, mixed = full_rank_folders(tmp_path / "mixed", dense_attention=(0,), **HEADS9)
    expected = {case: greedy_alone(hf, prompts, new) for case, (prompts, new, _, _) in CASES.items()}
    results = run_ranks(3, tp3_worker, str(dec), str(mixed))[0]
    assert len(results) == 10
    for key, driven in results.items():
        check_case(key, driven, expected[key.rsplit("/", 1)[1]])


def pp2_worker(folder: str) -> dict[str, Any] | None:
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.specs.layout import Layout

    groups = init_parallel(1, 2)
    lead = groups.global_rank == 0
    out: dict[str, Any] = {}
    try:
        stage = load_folder(Path(folder), Layout.DEINFER, groups)
        for case in ("shared", "full-pool"):
            prompts, new, arrive, options = CASES[case]
            out[case] = drive_steps(stage, prompts, new, arrive, **options)
    finally:
        shutdown()
    return out if lead else None


def test_pp2_paged_steps_equal_generation_alone(tmp_path) -> None:
    """Two pipeline stages: the packed step's hidden states go from the first stage to the
    last, which samples; the tokens come back to rank 0's scheduler."""
    hf, _, dec = full_rank_folders(tmp_path, **HEADS9)
    results = run_ranks(2, pp2_worker, str(dec))[0]
    for case, driven in results.items():
        check_case(case, driven, greedy_alone(hf, CASES[case][0], CASES[case][1]))
