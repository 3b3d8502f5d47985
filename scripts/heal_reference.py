"""The single-process reference a user would write for ``heal``: a Hugging Face model whose
decomposed matrices are ``nn.Linear`` factor pairs, distilled from the dense teacher by the
same loss (token KL), AdamW and clipping, on the same windows; prints tokens/s per step.

    python scripts/heal_reference.py --model DEC --teacher DENSE --text FILE \\
        [--steps 6 --batch 2 --seq-len 256]

It measures the throughput ``heal --tp N`` is compared with (docs/HEALING.md); it writes nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from deinfer_megatron.models.hf_factored import hf_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--teacher", type=Path, required=True)
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    a = p.parse_args()
    torch.manual_seed(0)
    tok = transformers.AutoTokenizer.from_pretrained(a.teacher)
    ids = tok(a.text.read_text(), add_special_tokens=False)["input_ids"]
    n = a.batch * a.seq_len
    teacher = transformers.AutoModelForCausalLM.from_pretrained(a.teacher, dtype=torch.float32).eval()
    model = hf_model(a.model, trainable="factors")  # the package's builder: heal's one-process student, bench's hf peer
    params = [q for q in model.parameters() if q.requires_grad]
    optim = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95))
    for step in range(a.steps):
        t0 = time.perf_counter()
        batch = torch.tensor(ids[step * n:(step + 1) * n]).view(a.batch, a.seq_len)
        with torch.no_grad():
            target = F.log_softmax(teacher(batch).logits.float(), -1).flatten(0, 1)
        logp = F.log_softmax(model(batch).logits.float(), -1).flatten(0, 1)
        loss = F.kl_div(logp, target, log_target=True, reduction="batchmean")
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        dt = time.perf_counter() - t0
        print(json.dumps({"step": step + 1, "kl": loss.item(), "tokens_per_s": n / dt}), flush=True)


if __name__ == "__main__":
    main()
