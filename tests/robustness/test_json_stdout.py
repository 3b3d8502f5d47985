"""``generate --launcher torchrun|deepspeed --json``: stdout is the one JSON document.

The reported command: ``generate --tp 3 --launcher deepspeed --greedy --max-new-tokens 4 --json``
on a 9-head / 3-KV-head model, in the default ``--layout auto``, from an empty cache (the first
run on a machine measures its cost table, framework time at TP=3 included), then under torchrun
with the cache that run left. The DeepSpeed launcher logs to stdout and every process below the
command may print; each command runs as a user runs it (``harness.Job``: stdout and stderr
apart, a private TMPDIR, no process left behind), and the whole of its stdout must parse as one
JSON document whose tokens are Hugging Face's greedy tokens on the same (lossless, full-rank)
weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_models import full_rank_folders
from tests.robustness.harness import Job, Result

PROMPT = "It is a truth universally acknowledged"
NEW_TOKENS = 4
TP = 3


@pytest.fixture(scope="module")
def heads9(tmp_path_factory) -> dict:
    """The decomposed folder and Hugging Face's greedy continuation of ``PROMPT``."""
    import transformers

    root = tmp_path_factory.mktemp("json-stdout")
    hf, _, dec = full_rank_folders(root, hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                                   num_hidden_layers=2, max_position_embeddings=256)
    ids = transformers.AutoTokenizer.from_pretrained(dec)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return {"model": dec, "tokens": out[0, ids.shape[1]:].tolist()}


def _generate(model: Path, launcher: str, cache: Path, tmp: Path) -> Result:
    return Job("generate", "--model", str(model), "--tp", str(TP), "--launcher", launcher, "--greedy",
               "--max-new-tokens", str(NEW_TOKENS), "--prompt", PROMPT, "--json", tmp=tmp,
               env={"DEINFER_MEGATRON_CACHE": str(cache)}).finish(timeout=600)


def test_stdout_is_the_document_under_either_launcher(heads9, tmp_path: Path) -> None:
    cache = tmp_path / "cache"  # empty: the first command measures the cost table, the second reads it
    for launcher in ("deepspeed", "torchrun"):
        result = _generate(heads9["model"], launcher, cache, tmp_path)
        assert result.code == 0 and not result.survivors, (launcher, result.code, result.survivors,
                                                           result.stderr[-3000:])
        doc = json.loads(result.stdout)  # the whole of stdout: one document, nothing before or after it
        assert [o["token_ids"] for o in doc["outputs"]] == [heads9["tokens"]], launcher
        assert doc["tp"] == TP and doc["layout"] == "auto", launcher
