"""The precomputed top-k teacher (``healing.loss.teacher_topk`` / ``topk_kl``) against the textbook
formulas, and ``scripts/heal_teacher_compare.py`` on the tiny pair: at ``k`` = vocabulary its
top-k KL is the full KL, which is the KL transformers gives on the same windows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from deinfer_megatron.healing.loss import TAILS, teacher_topk, token_kl, topk_kl
from tests.healing.test_heal import _multiplied_out

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "heal_teacher_compare.py"


def _script():
    spec = importlib.util.spec_from_file_location("heal_teacher_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def _logits(vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 5, vocab, generator=gen), 2 * torch.randn(2, 5, vocab, generator=gen)


@pytest.mark.parametrize("tail", TAILS)
def test_topk_kl_at_the_full_vocabulary_is_the_full_kl_and_its_gradient(tail: str) -> None:
    s, t = _logits()
    s.requires_grad_(True)
    got = topk_kl(s, *teacher_topk(t, 11), tail=tail)
    want = token_kl(s, t)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    (g_got,), (g_want,) = torch.autograd.grad(got, s), torch.autograd.grad(want, s)
    assert torch.isfinite(g_got).all() and torch.allclose(g_got, g_want, atol=1e-7)


def test_topk_kl_below_the_vocabulary_is_the_textbook_formula() -> None:
    s, t = _logits()
    k = 4
    values, ids, tail = teacher_topk(t, k)
    p, q = t.double().softmax(-1), s.double().softmax(-1)
    top = p.topk(k, -1).indices
    assert torch.equal(ids.long(), top) and ids.dtype == torch.int32
    assert torch.allclose(values.double().exp().sum(-1) + tail.double().exp(), torch.ones(2, 5, dtype=torch.float64), atol=1e-6)
    p_s, q_s = p.gather(-1, top), q.gather(-1, top)
    p_rest, q_rest = 1 - p_s.sum(-1), 1 - q_s.sum(-1)
    bucket = ((p_s * (p_s / q_s).log()).sum(-1) + p_rest * (p_rest / q_rest).log()).mean()
    pn, qn = p_s / p_s.sum(-1, keepdim=True), q_s / q_s.sum(-1, keepdim=True)
    renorm = (pn * (pn / qn).log()).sum(-1).mean()
    assert topk_kl(s, values, ids, tail, "bucket").item() == pytest.approx(bucket.item(), rel=1e-5)
    assert topk_kl(s, values, ids, tail, "renorm").item() == pytest.approx(renorm.item(), rel=1e-5)
    assert bucket < token_kl(s, t).item()  # merging tokens never raises a KL
    with pytest.raises(ValueError, match="unknown tail handling 'x'"):
        topk_kl(s, values, ids, tail, "x")


def _run(capsys, *argv: str) -> dict:
    assert _script().main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_script_times_both_paths_and_agrees_with_transformers(pair, capsys) -> None:
    common = ("--model", str(pair.dec), "--teacher", str(pair.dense), "--text", str(pair.heal_text),
              "--steps", "2", "--skip", "1", "--batch", "2", "--seq-len", "32", "--max-tokens", "128")
    full = _run(capsys, *common, "--k", "49152")
    # the first batch's KL, computed by transformers on the dense teacher and the multiplied-out student
    tok = transformers.AutoTokenizer.from_pretrained(pair.dense)
    ids = torch.tensor(tok(pair.heal_text.read_text()[:5000], add_special_tokens=False)["input_ids"][:64]).view(2, 32)
    with torch.no_grad():
        t = transformers.AutoModelForCausalLM.from_pretrained(pair.dense).eval()(ids).logits.double()
        s = _multiplied_out(pair.dec)(ids).logits.double()
    p = t.softmax(-1)
    reference = float((p * (t.log_softmax(-1) - s.log_softmax(-1))).sum(-1).mean())
    assert full["first_kl_in_ranks"] == pytest.approx(reference, rel=1e-4)
    assert full["first_kl_topk"] == pytest.approx(full["first_kl_in_ranks"], rel=1e-5)
    assert full["loss"]["in_ranks"][0] == pytest.approx(full["first_kl_in_ranks"], rel=1e-5)  # the timed step's loss
    assert full["teacher_topk_mass"] == pytest.approx(1.0, abs=1e-4)
    for key in ("precompute_s_per_token", "median_teacher_s"):
        assert full[key] > 0
    assert full["median_step_s"]["in_ranks"] > 0 and full["median_step_s"]["topk"] > 0
    assert full["storage_bytes_per_token"] == 8 * 49152 + 4 and full["data_tokens"] == 128
    assert full["break_even_epochs"] is None or full["break_even_epochs"] > 0

    top = _run(capsys, *common, "--tail", "bucket")  # k = 64, the default
    assert top["storage_bytes_per_token"] == 8 * 64 + 4 and top["full_logits_bytes_per_token"] == 4 * 49152
    assert 0 < top["first_kl_topk"] < top["first_kl_in_ranks"] == pytest.approx(full["first_kl_in_ranks"], rel=1e-6)
    assert 0 < top["teacher_topk_mass"] < 1


def test_the_script_refuses_bad_input_in_one_line(pair, capsys) -> None:
    base = ["--model", str(pair.dec), "--teacher", str(pair.dense), "--text", str(pair.heal_text)]
    for extra, message in ((["--k", "0"], "--k must be a positive integer"),
                           (["--k", "50000"], "--k must be at most the vocabulary (49152)"),
                           (["--steps", "2", "--skip", "2"], "--skip must be at least 0 and less than --steps"),
                           (["--tail", "x"], "invalid choice: 'x'"),
                           (["--seq-len", "4096"], "--seq-len must be at most the model's context"),
                           (["--max-tokens", "8", "--seq-len", "32"], "must hold at least one --seq-len window")):
        assert _script().main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (extra, err)
    swapped = ["--model", str(pair.dense), "--teacher", str(pair.dense), "--text", str(pair.heal_text)]
    assert _script().main(swapped) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not decomposed" in err[0], err
