"""examples/megatron_api.py and examples/load_at_other_tp.py, run as a user runs them, against
Hugging Face with the factors multiplied out.

The example builds Megatron's ``GPTModel`` from our block spec and loads it itself; the
reference is transformers' own model of the same architecture whose decomposed matrices are
replaced by ``U @ V`` — computed here from the raw tensors, with nothing of deinfer_megatron in
the reference forward. A wrong spec, a factor loaded into the wrong slot or a layer that drops a
bias changes the logits by far more than the float32 tolerance of DESIGN §5.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping

import pytest
import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "megatron_api.py"


def example_env() -> dict[str, str]:
    """The environment an example runs in: this checkout importable, one thread per process."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1"}


def multiplied_out_llama(synthetic: str, state: Mapping[str, torch.Tensor]) -> transformers.PreTrainedModel:
    """transformers' own LLaMA of the synthetic config ``synthetic``, loaded with ``state``'s
    factors multiplied out (the independent reference)."""
    from deinfer_megatron.models.synthetic import synthetic_config

    cfg = synthetic_config(synthetic)
    cfg.pop("model_type")
    config = transformers.LlamaConfig(**cfg)
    config._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.load_state_dict(multiplied_out(state), strict=True)
    return hf


def run_example(tmp_path: Path, *args: str) -> dict[str, torch.Tensor]:
    """Run the example in a fresh interpreter (it owns its process group) and read its logits."""
    out = tmp_path / "logits.pt"
    env = example_env()
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args, "--save-logits", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, f"the example failed:\n{proc.stdout}\n{proc.stderr}"
    assert "greedy next tokens" in proc.stdout, proc.stdout
    return torch.load(out)


def multiplied_out(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``<m>.u``/``<m>.v`` → ``<m>.weight = U @ V``; every other tensor as it is."""
    dense = {k: v for k, v in state.items() if not k.endswith((".u", ".v"))}
    for key in state:
        if key.endswith(".u"):
            module = key[: -len(".u")]
            dense[f"{module}.weight"] = state[key] @ state[f"{module}.v"]
    return dense


def assert_matches(got: dict[str, torch.Tensor], hf: transformers.PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        ref = hf(got["input_ids"]).logits
    logits = got["logits"]
    assert logits.shape == ref.shape
    scale = max(1.0, ref.abs().max().item())
    assert (logits - ref).abs().max().item() <= 1e-4 * scale
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    return ref


def test_random_factors_match_multiplied_out_llama(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("megatron_api", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # defines functions only; main() is not called
    got = run_example(tmp_path)
    arch, rank_config, state = example.synthetic_source()  # the same seed: the same tensors
    assert [layer.decomposed for layer in rank_config.layers] == [True, True, True, False]

    hf = multiplied_out_llama(example.SYNTHETIC, state)
    assert_matches(got, hf)


@pytest.mark.parametrize("family, layout", [("qwen2", "naive"), ("opt", "deinfer")])
def test_decomposed_folder_matches_multiplied_out(family: str, layout: str, tmp_path: Path) -> None:
    """A folder from ``decompose`` (svd, ratio 0.5, layers 0-2; layer 3 stays dense): QKV
    biases and tied embeddings (Qwen2), biases, LayerNorm, ReLU and learned positions (OPT)."""
    from safetensors.torch import load_file

    from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
    from tests.helpers.tiny_models import save_tiny_folder

    hf = save_tiny_folder(family, tmp_path / "dense")
    model = run_decompose(DecomposeJob(tmp_path / "dense", "svd", ratio=0.5, layers="0-2", out=tmp_path / "dec"))
    got = run_example(tmp_path, "--model", str(model), "--layout", layout)

    with torch.no_grad():
        dense_logits = hf(got["input_ids"]).logits
    factors = load_file(model / "model.safetensors")
    decomposed = {k[: -len(".u")] for k in factors if k.endswith(".u")}
    assert decomposed and all(".layers.3." not in name for name in decomposed)
    modules = dict(hf.named_modules())
    with torch.no_grad():
        for name in decomposed:
            modules[name].weight.copy_(factors[f"{name}.u"] @ factors[f"{name}.v"])
    ref = assert_matches(got, hf)
    # the factors must matter, or the comparison above would not test them
    assert (ref - dense_logits).abs().max().item() > 1e-2 * max(1.0, ref.abs().max().item())


TRAIN_EXAMPLE = REPO_ROOT / "examples" / "train_megatron.py"


def run_train_example(tmp_path: Path, *args: str) -> tuple[list[float], str]:
    out = tmp_path / f"losses{len(list(tmp_path.iterdir()))}.json"
    env = example_env()
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, str(TRAIN_EXAMPLE), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, f"the example failed:\n{proc.stdout}\n{proc.stderr}"
    assert "loss" in proc.stdout, proc.stdout
    import json

    return json.loads(out.read_text())["losses"], proc.stdout


def test_train_example_lowers_the_loss_from_an_untrained_start(tmp_path: Path) -> None:
    """From scratch the model predicts nearly uniformly (loss ≈ ln 256); 12 steps on the toy
    counting language lower it clearly; the naive layout, the same maths initialised with the
    same draws, follows the same losses."""
    import math

    deinfer, stdout = run_train_example(tmp_path, "--steps", "12", "--save", str(tmp_path / "ckpt"))
    assert len(deinfer) == 12
    # the trained model's dist checkpoint, loaded under the naive layout, gives its logits
    diff = [line for line in stdout.splitlines() if line.startswith("reloaded under naive:")]
    assert diff and float(diff[0].rsplit(" ", 1)[1]) < 1e-4, stdout
    assert (tmp_path / "ckpt" / "metadata.json").is_file()
    assert deinfer[0] == pytest.approx(math.log(256), rel=0.02)
    assert deinfer[-1] < deinfer[0] - 0.3, deinfer
    naive, _ = run_train_example(tmp_path, "--steps", "12", "--layout", "naive")
    assert naive == pytest.approx(deinfer, rel=1e-4)


def test_load_at_other_tp_generates_the_multiplied_out_tokens(tmp_path: Path) -> None:
    """examples/load_at_other_tp.py saves at TP=2 under deinfer and loads at TP=1 under naive:
    the prompt's logits and the greedy tokens are Hugging Face's with the factors multiplied out."""
    example_file = REPO_ROOT / "examples" / "load_at_other_tp.py"
    spec = importlib.util.spec_from_file_location("load_at_other_tp", example_file)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # defines functions only
    out = tmp_path / "logits.pt"
    env = example_env()
    proc = subprocess.run([sys.executable, str(example_file), "--save-tp", "2", "--load-tp", "1", "--layout", "naive",
                           "--save-logits", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, f"the example failed:\n{proc.stdout}\n{proc.stderr}"
    assert "saved at TP=2" in proc.stdout and "TP=1, layout naive: greedy tokens" in proc.stdout, proc.stdout
    got = torch.load(out)

    _, _, state = example.synthetic_model()
    hf = multiplied_out_llama(example.SYNTHETIC, state)
    assert_matches(got, hf)
    with torch.no_grad():
        want = hf.generate(got["input_ids"], max_new_tokens=got["tokens"].shape[1], do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert torch.equal(got["tokens"], want[:, got["input_ids"].shape[1]:])


HEAL_THEN_SERVE = REPO_ROOT / "examples" / "heal_then_serve.sh"


def _run_heal_then_serve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**example_env(), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(HEAL_THEN_SERVE), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_heal_then_serve_answers_what_generate_answers(tmp_path: Path, capfd) -> None:
    """examples/heal_then_serve.sh on its own tiny model: the served greedy chat answer is the
    one `deinfer-megatron generate --chat --greedy` gives on the healed folder, the folder's
    manifest records the healing, and the server is gone when the script returns."""
    import json

    from deinfer_megatron.checkpoints.folder import MANIFEST
    from deinfer_megatron.cli.main import run

    work = tmp_path / "work"
    proc = _run_heal_then_serve("--work", str(work), "--max-tokens", "8", "--tokens", "256")
    assert proc.returncode == 0, f"the example failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    with pytest.raises(ProcessLookupError):  # stopped and reaped by the script's trap
        os.kill(got["server_pid"], 0)
    assert sorted(p.name for p in work.iterdir()) == ["decomposed", "dense", "heal.jsonl", "healed", "serve.log"]
    healing = json.loads((work / "healed" / MANIFEST).read_text())["healing"]
    assert healing["teacher"] == str(work / "dense") and healing["student"] == str(work / "decomposed")
    assert healing["steps"] == 2 and healing["tokens"] == 256 and healing["first_kl"] > 0

    capfd.readouterr()
    assert run(["generate", "--model", got["healed"], "--layout", "deinfer", "--chat", "--greedy",  # serve's layout
                "--prompt", got["prompt"], "--max-new-tokens", "8", "--json"]) == 0
    want = json.loads(capfd.readouterr().out)["outputs"][0]
    assert got["answer"] == want["text"] and want["text"].strip()
    assert got["usage"]["completion_tokens"] == len(want["token_ids"])


def test_heal_then_serve_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    for args, message in ((("--work", str(tmp_path / "taken")), "exists; name a folder that does not"),
                          (("--tokens", "0"), "--tokens must be a positive integer"),
                          (("--dense", str(tmp_path)), "is not a model folder"),
                          (("--dense", str(tmp_path), "--smollm2"), "not both"),
                          (("--method", "pca"), "--method must be svd, asvd or svd-llm"),
                          (("--ratio", "1.5"), "--ratio must be in (0, 1]"),
                          (("--bogus",), "unknown argument --bogus")):
        proc = _run_heal_then_serve(*args, timeout=30)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (args, proc.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"] and not any((tmp_path / "taken").iterdir())
