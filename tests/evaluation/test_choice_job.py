"""``eval-choice`` against Hugging Face transformers: a tiny LLaMA with random low-rank factors
(its reference holds ``U·V`` multiplied out), hand-made items, and the log-likelihood of every
choice computed by transformers with lm-evaluation-harness's tokenisation written out here.
The project's parallel model must give the same per-choice log-likelihoods and the same acc and
acc_norm at TP=1, at TP=2 (through the command line, padded batches of a few requests) and at
PP=2 (the dense layout: the factors multiplied out at load)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.checkpoints.folder import write_decomposed
from deinfer_megatron.cli.main import run
from deinfer_megatron.evaluation.choice import ChoiceJob, evaluate_choices
from deinfer_megatron.specs.rank_config import RankConfig
from tests.helpers.tiny_models import decompose_randomly, mixed_ranks, save_tiny_folder

ITEMS = [
    {"context": "It is a truth universally", "choices": ["acknowledged.", "forgotten.", "a table."],
     "answer": 0, "category": "novel"},
    {"context": "Catherine Morland had never been", "choices": ["handsome.", "to Bath.", "seen", "x"],
     "answer": 1, "category": "novel"},
    {"context": "The quick brown fox jumps over the ", "choices": ["lazy dog.", "moon."], "answer": 0,
     "category": "novel"},  # trailing whitespace: moved into the continuation, as the harness does
    {"context": "def add(a, b):\n    return a\n", "choices": ["+ b", "- b", "* b", "or b", "if b"],
     "answer": 0, "category": "code"},
    {"context": "for i in range(10):", "choices": ["print(i)", "pass", "break"], "answer": 2,
     "category": "code"},
]


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("choice")
    hf = save_tiny_folder("llama", root / "dense")
    ranks = mixed_ranks(hf, [0, 2, 3])
    state = decompose_randomly(hf, ranks)  # hf now holds U·V: the reference
    arch = arch_from_hf_config(hf.config.to_dict())
    write_decomposed(root / "dec", config=json.loads((root / "dense" / "config.json").read_text()),
                     tensors=state, rank_config=RankConfig.from_mapping(ranks, arch),
                     tokenizer_dir=root / "dense", metadata={"method": "random"})
    items = root / "items.jsonl"
    items.write_text("".join(json.dumps(it) + "\n" for it in ITEMS))
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "dense")
    lls, tokens = [], 0
    for it in ITEMS:
        row = []
        for choice in it["choices"]:
            ctx, cont = harness_encode(tokenizer, it["context"], " " + choice)
            tokens += len(cont)
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([ctx + cont])).logits[0].double(), dim=-1)
            row.append(sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont)))
        lls.append(row)
    return {"dec": root / "dec", "items": items, "lls": lls, "tokens": tokens}


def harness_encode(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's ``_encode_pair`` for a causal model, written out."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def expected_accuracy(lls: list[list[float]]) -> tuple[float, float]:
    raw = [max(range(len(row)), key=row.__getitem__) for row in lls]
    norm = [max(range(len(row)), key=lambda k: row[k] / len(it["choices"][k])) for row, it in zip(lls, ITEMS)]
    return (sum(p == it["answer"] for p, it in zip(raw, ITEMS)) / len(ITEMS),
            sum(p == it["answer"] for p, it in zip(norm, ITEMS)) / len(ITEMS))


def assert_matches_reference(result: dict, case: dict) -> None:
    got = [r["loglikelihoods"] for r in result["per_item"]]
    assert [len(row) for row in got] == [len(row) for row in case["lls"]]
    for mine, theirs in zip(got, case["lls"]):
        assert mine == pytest.approx(theirs, rel=1e-4, abs=1e-4)
    acc, acc_norm = expected_accuracy(case["lls"])
    assert (result["acc"], result["acc_norm"]) == (acc, acc_norm)
    assert result["items"] == len(ITEMS) and result["requests"] == sum(len(it["choices"]) for it in ITEMS)
    assert result["tokens"] == case["tokens"]
    assert set(result["categories"]) == {"novel", "code"} and result["categories"]["code"]["items"] == 2


def test_tp1_matches_transformers(case) -> None:
    result = evaluate_choices(ChoiceJob(case["dec"], case["items"], layout="deinfer"))
    assert result["layout"] == "deinfer" and result["forwards"] == 1
    assert_matches_reference(result, case)


def test_tp2_command_line_matches_transformers(case, capsys) -> None:
    """Two ranks, the naive layout, forwards of at most 40 padded token rows (several requests
    per forward, of different lengths), through the command and its JSON."""
    assert run(["eval-choice", "--model", str(case["dec"]), "--items", str(case["items"]), "--tp", "2",
                "--layout", "naive", "--batch-tokens", "40", "--json", "--per-item"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["tp"], result["pp"], result["layout"]) == (2, 1, "naive") and result["forwards"] > 1
    assert_matches_reference(result, case)
    assert run(["eval-choice", "--model", str(case["dec"]), "--items", str(case["items"]), "--layout", "deinfer"]) == 0
    text = capsys.readouterr().out.splitlines()  # without --json: the summary, a line per category
    assert text[0].startswith(f"acc {result['acc']:.4f}  acc_norm {result['acc_norm']:.4f}  over 5 items")
    assert [line.split()[0] for line in text[1:]] == ["novel", "code"]


def test_pp2_dense_layout_matches_transformers(case) -> None:
    result = evaluate_choices(ChoiceJob(case["dec"], case["items"], pp=2, layout="dense", batch_tokens=64))
    assert (result["pp"], result["layout"]) == (2, "dense")
    assert_matches_reference(result, case)


def test_defaults_are_the_shipped_items_and_auto() -> None:
    from deinfer_megatron.cli.main import build_parser
    from deinfer_megatron.evaluation.items import SHIPPED_ITEMS

    args = build_parser().parse_args(["eval-choice", "--model", "m"])
    cfg = args.make_config(args)
    assert cfg.job.items == SHIPPED_ITEMS and cfg.job.layout.is_auto and cfg.job.batch_tokens == 2048
    assert not cfg.json and not cfg.per_item and cfg.job.verify
