"""Greedy generation at full rank equals Hugging Face ``generate`` on the dense model.

Tiny LLaMA / Qwen2 / OPT, every layout, TP=1, TP=2 and PP=2, KV cache full and latent, value
absorption on and off, Megatron's static engine and the project's loop, DeepSpeed-Inference at
TP=2, and a batch of ragged prompts equal to the prompts one at a time.
"""

from __future__ import annotations

import json

import pytest
import torch

from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
from tests.helpers.distributed import run_ranks
from tests.helpers.generation import generation_worker
from tests.helpers.tiny_models import full_ranks, save_tiny_folder

MAX_NEW = 8
PROMPTS = [[1, 504, 3458, 282, 4915, 314], [1, 9519, 12, 2834], [1, 378, 1345, 30, 1096, 3215, 281, 17]]
LAYOUTS = ["deinfer", "naive", "dense"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[dict[str, str], dict[str, list[list[int]]]]:
    """Full-rank decomposed folders and the dense model's greedy tokens, prompt by prompt."""
    root = tmp_path_factory.mktemp("gen")
    models, expected = {}, {}
    for family in ("llama", "qwen2", "opt"):
        hf = save_tiny_folder(family, root / f"{family}-dense")
        ranks = root / f"{family}-ranks.json"
        ranks.write_text(json.dumps(full_ranks(hf)))
        out = run_decompose(DecomposeJob(root / f"{family}-dense", "svd", rank_config=ranks,
                                         out=root / f"{family}-full"))
        models[family] = str(out)
        expected[family] = []
        for p in PROMPTS:
            ids = torch.tensor([p])
            with torch.no_grad():
                gen = hf.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
            expected[family].append(gen[0, len(p):].tolist())
    return models, expected


def check(results: dict, expected: dict, where: str) -> None:
    assert results, where
    for key, tokens in results.items():
        family = key.split("/")[0]
        if "/sampled/" in key:  # sampled, not greedy: only agreement across ranks is checked
            assert [len(t) for t in tokens] == [MAX_NEW] * len(PROMPTS), key
            continue
        assert tokens == expected[family], f"{where}: {key}"


def test_tp1_every_layout_cache_and_driver(folders) -> None:
    models, expected = folders
    results = run_ranks(1, generation_worker, 1, 1, models, PROMPTS, MAX_NEW, LAYOUTS, False, True)[0]
    assert sum("-chunked" in k for k in results) == 3 * (2 + 2 + 2 + 2), "chunked prefill: every driver and cache"
    assert any("/latent/rebuild/" in k for k in results) and any("/latent/absorb/" in k for k in results)
    assert sum("one-at-a-time" in k for k in results) == 3
    check(results, expected, "TP=1")


def test_tp2_with_deepspeed(folders) -> None:
    models, expected = folders
    per_rank = run_ranks(2, generation_worker, 2, 1, models, PROMPTS, MAX_NEW, LAYOUTS, True, True)
    assert per_rank[0] == per_rank[1], "both TP ranks see the same tokens (sampled ones too)"
    assert sum("/deepspeed/" in k for k in per_rank[0]) == 6
    check(per_rank[0], expected, "TP=2")


def test_pp2(folders) -> None:
    models, expected = folders
    per_rank = run_ranks(2, generation_worker, 1, 2, models, PROMPTS, MAX_NEW, ["deinfer", "naive"], False, True)
    assert per_rank[0] == per_rank[1], "both stages report the same tokens"
    check(per_rank[0], expected, "PP=2")
