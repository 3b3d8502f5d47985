"""The real model behind the server: SmolLM2 (full-rank decomposition) served at TP=3 with the
latent KV cache answers concurrent chat requests exactly as Hugging Face ``generate`` answers
each alone on the dense model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import torch
import transformers

from tests.helpers.serving import Server

QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?"]
MAX_TOKENS = 8


def test_tp3_latent_server_matches_transformers(smollm2: Path, smollm2_full_rank: Path, tmp_path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    expected = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        x = torch.tensor([ids])
        with torch.no_grad():  # an explicit mask: the prompt contains the pad id (<|im_end|>)
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False,
                              pad_token_id=tok.pad_token_id)
        expected.append(tok.decode(out[0, len(ids):], skip_special_tokens=True))
    server = Server(smollm2_full_rank, "--tp", "3", "--kv-cache", "latent", "--max-seq-len", "256",
                    "--served-model-name", "smollm2", log=tmp_path / "server.log")
    try:
        api = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)

        def ask(q: str) -> str:
            answer = api.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}],
                                                 max_tokens=MAX_TOKENS, temperature=0)
            return answer.choices[0].message.content

        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            assert list(pool.map(ask, QUESTIONS)) == expected
        assert "Paris" in expected[0]
        server.terminate()
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
