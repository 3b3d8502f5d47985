"""``deinfer-megatron generate`` as users run it: JSON and streamed output, the torchrun and
DeepSpeed launchers, one-line errors for bad input. (Dying ranks, killed commands and Ctrl-C
are in tests/robustness.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
from tests.helpers.tiny_models import full_ranks, save_tiny_folder

CLI = [sys.executable, "-m", "deinfer_megatron.cli.main"]
PROMPTS = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cli-gen")
    hf = save_tiny_folder("llama", root / "dense", max_position_embeddings=4096)
    (root / "ranks.json").write_text(json.dumps(full_ranks(hf)))
    dec = run_decompose(DecomposeJob(root / "dense", "svd", rank_config=root / "ranks.json", out=root / "dec"))
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(dec)
    expected = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, ids.shape[1]:].tolist())
    return {"dense": root / "dense", "dec": dec, "expected": expected}


def cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def generate_args(model: Path, *extra: str) -> list[str]:
    args = ["generate", "--model", str(model), "--max-new-tokens", "6", "--json"]
    for p in PROMPTS:
        args += ["--prompt", p]
    return args + list(extra)


def test_json_output(models) -> None:
    proc = cli(*generate_args(models["dec"], "--tp", "2", "--kv-cache", "latent"))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [o["token_ids"] for o in doc["outputs"]] == models["expected"]
    for out, prompt in zip(doc["outputs"], PROMPTS):
        assert out["prompt"] == prompt and out["finish_reason"] == "length" and out["text"]
    assert doc["timing"]["prefill_s"] > 0 and doc["timing"]["decode_tokens_per_s"] > 0
    assert doc["kv_cache_bytes"] > 0


def test_single_prompt_streams_text(models) -> None:
    proc = cli("generate", "--model", str(models["dec"]), "--max-new-tokens", "6", "--prompt", PROMPTS[0])
    assert proc.returncode == 0, proc.stderr
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(models["dec"])
    assert tok.decode(models["expected"][0], skip_special_tokens=True).strip() in proc.stdout


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_launchers_give_the_same_tokens(models, launcher: str) -> None:
    extra = ["--engine", "deepspeed"] if launcher == "deepspeed" else []
    proc = cli(*generate_args(models["dec"], "--tp", "2", "--launcher", launcher, *extra))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # stdout is the one JSON document, the launcher's logs go to stderr
    assert [o["token_ids"] for o in doc["outputs"]] == models["expected"]


def test_bad_inputs_are_one_line_errors(models, tmp_path: Path) -> None:
    long_prompt = "word " * 5000
    cases = [
        (["generate", "--model", str(models["dec"]), "--prompt", long_prompt], {}, "exceeds the model's context of 4096"),
        (["generate", "--model", str(models["dense"]), "--prompt", "Hi", "--kv-cache", "latent"], {}, "--kv-cache latent needs a decomposed model"),
        (["generate", "--model", str(models["dec"]), "--prompt", "  "], {}, "prompt 1 is empty"),
        (["generate", "--model", str(models["dec"]), "--prompt", "Hi"],
         {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
         "TP×PP = 1 but the deepspeed launcher started 2 ranks"),
        (["generate", "--model", str(models["dec"]), "--prompt", "Hi", "--tp", "3"], {}, "valid TP sizes: 1, 2, 4, 8"),
    ]
    for args, env, message in cases:
        proc = cli(*args, env=env, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (args[-2:], proc.stderr[-2000:])
