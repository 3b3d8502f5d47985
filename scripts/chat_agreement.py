"""How closely decomposed (or healed) chat models follow their dense model's greedy answers.

The demo judges a healed model by two greedy answers, a verdict one token can flip. This
measures the margin instead: the dense model answers twelve short chat questions greedily (the
demo's two among them); each candidate model then reads those answers teacher-forced, and we
report its mean log-probability of an answer, the share of answer tokens it would itself have
chosen (argmax agreement), and, at the token where the dense model says "Paris", its probability
of "Paris" and its three likeliest tokens. Weights are the folders' factors multiplied out into
the dense model's transformers class (checkpoints.loader.MultipliedOut), one process, float32.

    python scripts/chat_agreement.py --dense DENSE MODEL [MODEL ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from deinfer_megatron.checkpoints.folder import open_model
from deinfer_megatron.checkpoints.loader import MultipliedOut, read_block

PROMPTS = ("What is the capital of France?", "Give me one short tip for staying healthy.",
           "What is the capital of Germany?", "What is the capital of Italy?", "What is the capital of Japan?",
           "What is the largest planet in our solar system?", "Who wrote Romeo and Juliet?",
           "How many days are in a week?", "What color is the sky on a clear day?", "What is 2 + 2?",
           "What language is spoken in Spain?", "What is the boiling point of water in Celsius?")
ANSWER_TOKENS = 10


def load(dense: Path, folder: Path | None) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    if folder is not None:
        opened = open_model(folder)  # verified against its manifest
        weights = MultipliedOut(opened.source, opened.rank_config)
        missing, unexpected = model.load_state_dict(
            {k: v if torch.is_tensor(v := weights[k]) else read_block(v, slice(None)) for k in weights}, strict=False)
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"{folder} does not fit {dense}'s model: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
    return model


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dense", type=Path, required=True, help="the dense Hugging Face folder (the reference)")
    p.add_argument("models", type=Path, nargs="+", help="decomposed or healed folders to compare")
    a = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = transformers.AutoTokenizer.from_pretrained(a.dense)
    dense = load(a.dense, None)
    answers = []  # (prompt length, prompt + the dense model's greedy answer)
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        out = dense.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=ANSWER_TOKENS)
        answers.append((ids.shape[1], out))
    n, france = answers[0]
    paris = next(i for i, t in enumerate(france[0, n:].tolist()) if "Paris" in tok.decode([t]))
    print(f"dense: {tok.decode(france[0, n:], skip_special_tokens=True)!r} ...")
    for folder in a.models:
        model = load(a.dense, folder)
        logp_sum, agree, total = 0.0, 0, 0
        for n, out in answers:
            logits = model(out).logits[0, n - 1:-1].float()
            target = out[0, n:]
            logp_sum += torch.log_softmax(logits, -1).gather(-1, target[:, None]).sum().item()
            agree += int((logits.argmax(-1) == target).sum())
            total += len(target)
        n, france = answers[0]
        at = torch.softmax(model(france[:, : n + paris]).logits[0, -1].float(), -1)
        top = at.topk(3)
        likeliest = ", ".join(f"{tok.decode([int(i)])!r} {float(v):.3f}" for v, i in zip(top.values, top.indices))
        print(f"{folder}: mean log-prob of an answer {logp_sum / len(answers):.2f}, agreement {agree / total:.3f}, "
              f"P(Paris) {float(at[france[0, n + paris]]):.3f}; likeliest: {likeliest}")


if __name__ == "__main__":
    main()
