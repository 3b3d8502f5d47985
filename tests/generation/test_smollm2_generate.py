"""The real model: greedy generation of full-rank SmolLM2 at TP=3 equals Hugging Face
``generate`` on the dense SmolLM2, in every layout, with both KV caches and both drivers."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.helpers.distributed import run_ranks
from tests.helpers.generation import generation_worker

QUESTIONS = ["What is the capital of France?", "Name three colours."]
MAX_NEW = 8


def test_tp3_matches_transformers(smollm2: Path, smollm2_full_rank: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    prompts, expected = [], []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        prompts.append(list(ids))
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=tok.pad_token_id)
        expected.append(out[0, len(ids):].tolist())
    results = run_ranks(3, generation_worker, 3, 1, {"smollm2": str(smollm2_full_rank)}, prompts,
                        MAX_NEW, ["deinfer", "naive", "dense"])
    assert results[0] == results[1] == results[2]
    assert len(results[0]) == 10
    for key, tokens in results[0].items():
        assert tokens == expected, key
    assert "Paris" in tok.decode(expected[0])
