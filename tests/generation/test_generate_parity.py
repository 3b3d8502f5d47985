"""Greedy generation at full rank equals Hugging Face ``generate`` on the dense model.

Tiny LLaMA / Qwen2 / OPT, every layout, TP=1, TP=2 and PP=2, KV cache full and latent, value
absorption on and off, Megatron's static engine and the project's loop, DeepSpeed-Inference at
TP=2, and a batch of ragged prompts equal to the prompts one at a time.

bfloat16 (``--dtype bfloat16``), on the same ranks, against transformers run in bfloat16 on the
dense LLaMA (``tests.helpers.bf16``): every layout's logits within 3 times transformers' own
bfloat16 error (its bfloat16 logits against its float32 ones), greedy tokens equal on prompts
whose every step is decided by more than twice that tolerance, caches in bfloat16 at the
planner's bytes, and eval-ppl's perplexity within the bound the logits' tolerance gives it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
from tests.helpers.bf16 import TOLERANCE, bf16_error, decided
from tests.helpers.distributed import run_ranks
from tests.helpers.generation import Bf16Case, generation_worker
from tests.helpers.text import real_text_file
from tests.helpers.tiny_models import full_ranks, save_tiny_folder

MAX_NEW = 8
PROMPTS = [[1, 504, 3458, 282, 4915, 314], [1, 9519, 12, 2834], [1, 378, 1345, 30, 1096, 3215, 281, 17]]
LAYOUTS = ["deinfer", "naive", "dense"]
BF16_NEW = 6


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


@pytest.fixture(scope="module")
def bf16(folders, tmp_path_factory) -> dict:
    """Transformers' bfloat16 reference for the LLaMA folder: the tolerance, prompts whose greedy
    steps all have a top-1/top-2 margin above twice it (there every implementation within the
    tolerance picks the same token), their tokens and teacher-forced logits, and a perplexity."""
    models, _ = folders
    dense = Path(models["llama"]).parent / "llama-dense"
    hf = {dt: transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=dt).eval()
          for dt in (torch.float32, torch.bfloat16)}
    tol = TOLERANCE * bf16_error(hf[torch.float32], hf[torch.bfloat16])
    sequences = decided(hf[torch.bfloat16], tol, new=BF16_NEW)
    text = real_text_file(tmp_path_factory.mktemp("bf16-text"), 4000, "evaluation")
    window, max_tokens = 32, 128
    tok = transformers.AutoTokenizer.from_pretrained(dense)  # the windows as eval-ppl documents them
    ids = tok(text.read_text(), add_special_tokens=False)["input_ids"][:max_tokens]
    windows = torch.tensor(ids[: len(ids) // window * window]).view(-1, window)
    with torch.no_grad():
        logits = hf[torch.bfloat16](sequences).logits.float()
        wl = hf[torch.bfloat16](windows).logits.float()
    nll = F.cross_entropy(wl[:, :-1].reshape(-1, wl.shape[-1]), windows[:, 1:].reshape(-1))
    case = Bf16Case(models["llama"], sequences[:, :6].tolist(), BF16_NEW, sequences.tolist(), str(text), window,
                    max_tokens)
    return {"case": case, "tol": tol, "tokens": sequences[:, 6:].tolist(), "logits": logits,
            "ppl": math.exp(nll.item()), "windows": windows.shape[0]}


def check_bf16(got: dict, ref: dict, where: str) -> None:
    """One rank's bfloat16 results (``tests.helpers.generation.bf16_checks``) against transformers'."""
    assert got["param_dtypes"] == {"torch.bfloat16"}, (where, got["param_dtypes"])
    assert len(got["tokens"]) == 2 * 3 + 3, where  # every cache and driver of deinfer, naive's and dense's
    for key, tokens in got["tokens"].items():
        assert tokens == ref["tokens"], f"{where} bf16 {key}"
        dtypes, held, planned = got["caches"][key]
        assert dtypes == {"torch.bfloat16"} and held == planned, (where, key, dtypes, held, planned)
    for layout, logits in got["logits"].items():
        assert logits.dtype == torch.bfloat16, (where, layout)
        diff = (logits.float() - ref["logits"]).abs().max().item()
        assert diff <= ref["tol"], f"{where} bf16 {layout}: logits differ by {diff:.4g} > {ref['tol']:.4g}"
    for layout, result in got["ppl"].items():
        # every token's NLL moves by at most twice the logits' largest difference (its target's
        # logit and the log-sum-exp), so log-perplexity does too
        assert result["dtype"] == "bfloat16" and result["windows"] == ref["windows"], (where, layout)
        assert abs(math.log(result["ppl"]) - math.log(ref["ppl"])) <= 2 * ref["tol"], (where, layout, result["ppl"], ref["ppl"])


def check(results: dict, expected: dict, where: str) -> None:
    assert results, where
    for key, tokens in results.items():
        family = key.split("/")[0]
        if "/sampled/" in key:  # sampled, not greedy: only agreement across ranks is checked
            assert [len(t) for t in tokens] == [MAX_NEW] * len(PROMPTS), key
            continue
        assert tokens == expected[family], f"{where}: {key}"


def test_tp1_every_layout_cache_and_driver(folders, bf16) -> None:
    models, expected = folders
    results = run_ranks(1, generation_worker, 1, 1, models, PROMPTS, MAX_NEW, LAYOUTS, False, True, bf16["case"])[0]
    check_bf16(results.pop("bf16"), bf16, "TP=1")
    assert sum("-chunked" in k for k in results) == 3 * (2 + 2 + 2 + 2), "chunked prefill: every driver and cache"
    assert any("/latent/rebuild/" in k for k in results) and any("/latent/absorb/" in k for k in results)
    assert sum("one-at-a-time" in k for k in results) == 3
    check(results, expected, "TP=1")


def test_tp2_with_deepspeed(folders, bf16) -> None:
    models, expected = folders
    per_rank = run_ranks(2, generation_worker, 2, 1, models, PROMPTS, MAX_NEW, LAYOUTS, True, True, bf16["case"])
    for rank, result in enumerate(per_rank):
        check_bf16(result.pop("bf16"), bf16, f"TP=2 rank {rank}")
    assert per_rank[0] == per_rank[1], "both TP ranks see the same tokens (sampled ones too)"
    assert sum("/deepspeed/" in k for k in per_rank[0]) == 6
    check(per_rank[0], expected, "TP=2")


def test_pp2(folders) -> None:
    models, expected = folders
    per_rank = run_ranks(2, generation_worker, 1, 2, models, PROMPTS, MAX_NEW, ["deinfer", "naive"], False, True)
    assert per_rank[0] == per_rank[1], "both stages report the same tokens"
    check(per_rank[0], expected, "PP=2")
