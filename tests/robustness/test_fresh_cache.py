"""The default ``--layout auto`` on a machine that has never measured itself: an empty cache.

A new user's first ``generate`` calibrates the cost table, framework time at the job's TP size
included, on models of the calibration's own. Those must split at any TP size the job's model
allows — 3 for SmolLM2's 9 heads / 3 KV heads, 5 here (``tests/planning/test_overhead.py``
checks the calibration models' shapes at every size from 1 to 12 without launching) — and a
calibration that cannot finish (a measuring rank killed) must leave the job on a fixed layout
with one warning line, not fail it, and its cache as it was. Every answer is checked against
Hugging Face on the same (lossless, full-rank) weights. Commands run side by side, each as a real
process (``harness.Job``), so none may leave a process behind.

At TP=3 the first command on the empty cache — ``generate``, the command reported with
``--launcher deepspeed --json > out.json``: the DeepSpeed launcher logs to stdout and every
process below the command may print, yet the whole of its stdout must parse as one JSON
document — measures the machine and the framework time at TP=3; ``eval-ppl``, ``bench`` and
``generate`` under torchrun then run on the cache it left, each measuring only its own job's
matrix products and attention cases (the one runtime resolves ``auto`` for every command, so
the framework time is measured once per machine and TP size, not per command). The killed
calibration starts from a cache that has this machine's rates but no framework time at TP=3 (a
user who ran at another TP size before): the rates would be the same seconds measured twice
beside the first command. At TP=5 ``generate`` starts from an empty cache of its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deinfer_megatron.planning import cost_model
from tests.helpers.cost_tables import elements_only
from tests.helpers.text import real_text_file
from tests.helpers.tiny_models import full_rank_folders
from tests.robustness.harness import Job, Result

PROMPT = "It is a truth universally acknowledged"
NEW_TOKENS = 4
WINDOW = 32
SHAPES = {  # name: (Hugging Face overrides, the TP sizes run on it)
    "heads9": dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, intermediate_size=96),
    "heads30": dict(hidden_size=120, num_attention_heads=30, num_key_value_heads=30, intermediate_size=96),
}


def _reference(hf, folder: Path, text: Path) -> dict:
    """Hugging Face's greedy tokens for ``PROMPT`` and perplexity over ``text`` in ``WINDOW``-token
    windows (the text's tokens without special tokens, cut evenly, as eval-ppl documents)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        text_ids = tok(text.read_text(), add_special_tokens=False)["input_ids"][:4096]
        n = len(text_ids) // WINDOW
        windows = torch.tensor(text_ids[: n * WINDOW]).view(n, WINDOW)
        logits = hf(windows).logits
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1), reduction="sum")
    return {"tokens": out[0, ids.shape[1]:].tolist(), "ppl": math.exp(nll.item() / windows[:, 1:].numel())}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fresh-cache")
    text = real_text_file(root, 6000, "evaluation")
    out = {}
    for name, overrides in SHAPES.items():
        hf, _, dec = full_rank_folders(root / name, num_hidden_layers=2, max_position_embeddings=256, **overrides)
        out[name] = {"model": dec, **_reference(hf, dec, text)}
    return {"text": text, **out}


def _generate(model: Path, tp: int) -> tuple[str, ...]:
    return ("generate", "--model", str(model), "--tp", str(tp), "--greedy", "--max-new-tokens", str(NEW_TOKENS),
            "--prompt", PROMPT, "--json")


def _eval(model: Path, tp: int, text: Path) -> tuple[str, ...]:
    return ("eval-ppl", "--model", str(model), "--tp", str(tp), "--text", str(text), "--window", str(WINDOW), "--json")


def _together(tmp_path: Path, commands: dict[str, tuple[tuple[str, ...], dict[str, str]]]) -> dict[str, Result]:
    """Start every command at once, each with an empty cache ``tmp_path/<name>``; wait for all."""
    jobs = {name: Job(*args, tmp=tmp_path, env={"DEINFER_MEGATRON_CACHE": str(tmp_path / name), **env})
            for name, (args, env) in commands.items()}
    return {name: job.finish(timeout=900) for name, job in jobs.items()}


def _ok(result: Result) -> dict:
    assert result.code == 0 and not result.survivors, (result.code, result.survivors, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout)


def _measured(cache: Path, tp: int) -> dict:
    """The TP size's fixed times in the table the command cached: every layout measured."""
    (table,) = (cache / "cost_model").glob("*.json")
    entry = json.loads(table.read_text())["overhead"][str(tp)]
    assert set(entry["blocks"]) == {"deinfer", "naive", "dense"}, entry
    return entry


def test_tp3_on_a_9_head_model_from_an_empty_cache(shapes, tmp_path) -> None:
    """generate calibrates an empty cache at TP=3 and runs; eval-ppl, bench and a second generate
    then run on that cache without measuring the framework time again; a calibration whose
    measuring ranks are killed (``overhead.rank``) falls back to DeInfer with one warning line and
    leaves its cache as it was."""
    model, text = shapes["heads9"]["model"], shapes["text"]
    fresh = {"DEINFER_MEGATRON_CACHE": str(tmp_path / "fresh")}
    key = cost_model.TableKey.current(1)  # the key of the ranks' one thread (the harness sets OMP_NUM_THREADS=1)
    rates_only = cost_model.cache_path(key, tmp_path / "killed" / "cost_model")
    cost_model.save(replace(elements_only(), key=key), rates_only)
    before = rates_only.read_bytes()
    first = _together(tmp_path, {
        "generate": ((*_generate(model, 3), "--launcher", "deepspeed"), fresh),
        "killed": (_generate(model, 3), {"DEINFER_MEGATRON_KILL_AT": "overhead.rank"}),
    })
    doc = _ok(first["generate"])  # the whole stdout under the DeepSpeed launcher: one document
    assert doc["layout"] == "auto" and doc["tp"] == 3
    assert doc["outputs"][0]["token_ids"] == shapes["heads9"]["tokens"]
    assert "framework time at TP=3" in first["generate"].stderr, "the empty cache was measured"
    _measured(tmp_path / "fresh", 3)

    doc = _ok(first["killed"])
    assert doc["layout"] == "deinfer" and doc["outputs"][0]["token_ids"] == shapes["heads9"]["tokens"]
    warnings = [line for line in first["killed"].lines if "WARNING" in line]
    assert len(warnings) == 1 and "using the deinfer layout for every block" in warnings[0], first["killed"].stderr
    assert "could not measure this machine's cost table" in warnings[0] and "framework time at TP=3" in warnings[0]
    assert "rates" not in warnings[0], "the planted rates were taken: only the framework time was measured"
    assert [p.name for p in (tmp_path / "killed").rglob("*.json")] == [rates_only.name]
    assert rates_only.read_bytes() == before, "a failed calibration caches nothing"

    then = _together(tmp_path, {
        "generate": ((*_generate(model, 3), "--launcher", "torchrun"), fresh),
        "eval": (_eval(model, 3, text), fresh),
        "bench": (("bench", "--model", str(model), "--tp", "3", "--layouts", "auto", "--batch", "1",
                   "--prompt-len", "8", "--gen-len", "2", "--repeats", "1", "--json", str(tmp_path / "bench.json"),
                   "--no-progress"), fresh),
    })
    doc = _ok(then["generate"])
    assert doc["layout"] == "auto" and doc["outputs"][0]["token_ids"] == shapes["heads9"]["tokens"]
    assert "measuring" not in then["generate"].stderr, "the cache the first run left is complete for it"
    for name in ("eval", "bench"):
        assert "framework time" not in then[name].stderr, (name, then[name].stderr[-3000:])

    doc = _ok(then["eval"])
    assert doc["ppl"] == pytest.approx(shapes["heads9"]["ppl"], rel=1e-3)

    assert then["bench"].code == 0, then["bench"].stderr[-3000:]
    bench = json.loads((tmp_path / "bench.json").read_text())
    (cell,) = bench["cells"]
    assert cell["layout"] == "auto" and cell["status"] == "ok" and cell["summary"]["plan_match"], cell
    _measured(tmp_path / "fresh", 3)


def test_tp5_from_an_empty_cache(shapes, tmp_path) -> None:
    """A TP size that is not a power of two and not SmolLM2's: generate at 5 (30 heads and KV heads)."""
    results = _together(tmp_path, {"generate": (_generate(shapes["heads30"]["model"], 5), {})})
    doc = _ok(results["generate"])
    assert doc["layout"] == "auto" and doc["outputs"][0]["token_ids"] == shapes["heads30"]["tokens"]
    _measured(tmp_path / "generate", 5)
