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
        x = torch.tensor([ids])
        with torch.no_grad():  # an explicit mask: the prompt contains the pad id (<|im_end|>)
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                              do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
        expected.append(out[0, len(ids):].tolist())
    results = run_ranks(3, generation_worker, 3, 1, {"smollm2": str(smollm2_full_rank)}, prompts,
                        MAX_NEW, ["deinfer", "naive", "dense"])
    assert results[0] == results[1] == results[2], "every rank sees the same tokens (sampled too)"
    greedy = {k: v for k, v in results[0].items() if "/sampled/" not in k}
    assert len(greedy) == 10  # deinfer: 5 cache/driver combos + one at a time; naive 2; dense 2
    for key, tokens in greedy.items():
        assert tokens == expected, key
    assert "Paris" in tok.decode(expected[0])
