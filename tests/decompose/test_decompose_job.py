"""``decompose`` end to end on tiny LLaMA / Qwen2 / OPT folders, checked against transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deinfer_megatron.checkpoints.folder import open_model
from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
from deinfer_megatron.evaluation.perplexity import PerplexityJob, evaluate, token_windows
from tests.helpers.text import real_text_file
from tests.helpers.tiny_models import full_ranks, hf_greedy_alone, save_tiny_folder

TEXT_CHARS = 20_000  # well over the 512 tokens each job reads (about 4 characters a token)


def hf_perplexity(model, windows: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(windows).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    return math.exp(nll.item())


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
def test_full_rank_reproduces_dense_logits_and_perplexity(family: str, tmp_path: Path) -> None:
    dense_dir = tmp_path / "dense"
    hf = save_tiny_folder(family, dense_dir)
    ranks = tmp_path / "ranks.json"
    ranks.write_text(json.dumps(full_ranks(hf)))
    calib = real_text_file(tmp_path, TEXT_CHARS, "calibration")
    text = real_text_file(tmp_path, TEXT_CHARS, "evaluation")
    out = run_decompose(DecomposeJob(
        dense_dir, "svd-llm", rank_config=ranks, calib_text=calib, calib_tokens=512,
        calib_seq_len=128, out=tmp_path / "dec"))
    folder = open_model(out)
    assert folder.decomposed and set(folder.rank_config.modules) == set(full_ranks(hf))

    job = PerplexityJob(out, text, max_tokens=512, window=128, layout="deinfer")
    windows = token_windows(out, text, 512, 128)
    expected = hf_perplexity(hf, windows)
    got = evaluate(job)
    assert got["tokens"] == windows[:, 1:].numel() and got["windows"] == 4
    assert got["ppl"] == pytest.approx(expected, rel=1e-4)
    one = evaluate(PerplexityJob(out, text, 512, 128, layout="deinfer", batch=1))  # a forward per window
    assert one["ppl"] == pytest.approx(expected, rel=1e-4)
    assert evaluate(PerplexityJob(dense_dir, text, 512, 128))["ppl"] == pytest.approx(expected, rel=1e-4)
    auto = evaluate(PerplexityJob(out, text, 512, 128, layout="auto"))  # the cost model's plan per block
    assert auto["layout"] == "auto" and auto["ppl"] == pytest.approx(expected, rel=1e-4)


def test_folder_contents_and_integrity_checks(tmp_path: Path) -> None:
    dense_dir = tmp_path / "dense"
    hf = save_tiny_folder("llama", dense_dir)
    out = run_decompose(DecomposeJob(
        dense_dir, "svd", ratio=0.5, layers="1-2", out=tmp_path / "dec"))
    manifest = json.loads((out / "deinfer_manifest.json").read_text())
    assert manifest["method"] == "svd" and manifest["layers"] == [1, 2]
    assert {"config.json", "rank_config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    folder = open_model(out)
    assert not folder.rank_config.layers[0].decomposed and folder.rank_config.layers[1].decomposed
    assert "model.layers.0.self_attn.q_proj.weight" in folder.source
    assert "model.layers.1.self_attn.q_proj.u" in folder.source
    assert not list(tmp_path.glob(".dec.tmp-*")), "no temporary folder left behind"

    # the factors and the rank config must agree
    rank_file = out / "rank_config.json"
    ranks = json.loads(rank_file.read_text())
    ranks["model.layers.1.self_attn.q_proj"] += 1
    rank_file.write_text(json.dumps(ranks))
    with pytest.raises(ValueError, match="rank_config.json is corrupted"):
        open_model(out)  # the manifest catches the edit first
    with pytest.raises(ValueError, match=r"q_proj.u has rank .* but rank_config.json says"):
        open_model(out, verify=False)

    # a flipped byte in the weights names the file
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors is corrupted"):
        open_model(out)
    del hf


@pytest.mark.parametrize(
    "job_kwargs, message",
    [
        (dict(method="svd", ratio=1.5), r"--ratio must be in \(0, 1\]"),
        (dict(method="svd", ratio=0.0), r"--ratio must be in \(0, 1\]"),
        (dict(method="svd-llm", ratio=0.5), r"needs calibration data: pass --calib-text"),
        (dict(method="svd", ratio=0.5, layers="0-9"), r"--layers '0-9' names layers outside 0\.\.3"),
        (dict(method="svd"), r"exactly one of --ratio R or --rank-config"),
        (dict(method="svd", ratio=1.0), r"--ratio 1 keeps every block dense .* use a lower --ratio"),
        (dict(method="svd", ratio=0.5, update="sequential"), r"--update sequential fits the factors to calibration"),
        (dict(method="svd", ratio=0.5, allocation="fisher"), r"--allocation fisher measures .* on calibration data"),
        (dict(method="svd", ratio=0.5, allocation="greedy"), r"unknown --allocation 'greedy'; choose one of uniform"),
        (dict(method="svd", ratio=0.5, update="twice"), r"unknown --update 'twice'; choose one of none, sequential"),
    ],
)
def test_bad_decompose_inputs(job_kwargs: dict, message: str, tmp_path: Path) -> None:
    save_tiny_folder("llama", tmp_path / "dense")
    with pytest.raises(ValueError, match=message):
        run_decompose(DecomposeJob(tmp_path / "dense", out=tmp_path / "o", **job_kwargs))
    assert not (tmp_path / "o").exists()


def test_rank_config_naming_unknown_module_and_unsupported_arch(tmp_path: Path) -> None:
    save_tiny_folder("llama", tmp_path / "dense")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model.layers.0.mlp.gate": 4}))
    with pytest.raises(ValueError, match="unknown module 'model.layers.0.mlp.gate'"):
        run_decompose(DecomposeJob(tmp_path / "dense", "svd", rank_config=bad))
    cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "dense" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architecture.*supported: llama"):
        run_decompose(DecomposeJob(tmp_path / "dense", "svd", ratio=0.5))


def test_text_shorter_than_a_window(tmp_path: Path) -> None:
    save_tiny_folder("llama", tmp_path / "dense")
    short = tmp_path / "short.txt"
    short.write_text("Only a few words.")
    with pytest.raises(ValueError, match="fewer than one window of 64"):
        evaluate(PerplexityJob(tmp_path / "dense", short, window=64))  # the context is 128


def test_several_calibration_files_share_the_windows(tmp_path: Path) -> None:
    """``--calib-text A B``: the windows are split equally (the first file takes the remainder),
    each file giving its own first windows, as its own tokenisation cuts them; the manifest
    names both files; a budget with fewer windows than files is refused before any loading."""
    import transformers

    from deinfer_megatron.cli.main import run
    from deinfer_megatron.decompose.calibration import text_windows

    save_tiny_folder("llama", tmp_path / "dense")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "dense")
    a = real_text_file(tmp_path, TEXT_CHARS, "calibration")
    b = real_text_file(tmp_path, TEXT_CHARS, "evaluation")
    first = [tok(f.read_text(), add_special_tokens=False)["input_ids"] for f in (a, b)]
    read = text_windows(tok, [a, b], seq_len=32, max_tokens=5 * 32 + 7)  # 5 windows: 3 + 2
    assert torch.equal(read, torch.tensor(first[0][: 3 * 32] + first[1][: 2 * 32]).view(5, 32))
    assert torch.equal(text_windows(tok, a, seq_len=32, max_tokens=5 * 32), torch.tensor(first[0][:160]).view(5, 32))

    assert run(["decompose", "--model", str(tmp_path / "dense"), "--method", "svd-llm", "--ratio", "0.5",
                "--calib-text", str(a), str(b), "--calib-tokens", "160", "--calib-seq-len", "32",
                "--out", str(tmp_path / "dec")]) == 0
    manifest = json.loads((tmp_path / "dec" / "deinfer_manifest.json").read_text())
    assert manifest["calibration"] == {"source": "text:calibration.txt,evaluation.txt", "tokens": 160, "seq_len": 32}
    with pytest.raises(ValueError, match="--calib-tokens 40 makes 1 windows of 32 for 2 --calib-text files"):
        run_decompose(DecomposeJob(tmp_path / "dense", "svd-llm", ratio=0.5, calib_text=(a, b), calib_tokens=40,
                                   calib_seq_len=32, out=tmp_path / "never"))
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("chat", [True, False], ids=["chat-template", "bos-only"])
def test_self_calibration_needs_no_text(chat: bool, tmp_path: Path) -> None:
    save_tiny_folder("qwen2", tmp_path / "dense")
    if not chat:  # without a chat template the model samples from its BOS token
        cfg_path = tmp_path / "dense" / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("chat_template", None)
        cfg_path.write_text(json.dumps(cfg))
        (tmp_path / "dense" / "chat_template.jinja").unlink(missing_ok=True)
    out = run_decompose(DecomposeJob(tmp_path / "dense", "svd-llm", ratio=0.6, allocation="variadic",
                                     calib_self=2, calib_seq_len=32, out=tmp_path / "dec"))
    manifest = json.loads((out / "deinfer_manifest.json").read_text())
    source = "self-dialogues:2" if chat else "self:2"
    assert manifest["calibration"] == {"source": source, "tokens": 64, "seq_len": 32, "temperature": 1.0}
    folder = open_model(out)
    ranks = folder.rank_config.modules
    shapes = folder.arch.linear_shapes()
    assert ranks and set(ranks) <= set(shapes)
    # variadic keeps the uniform budget, the blocks it kept dense counted at m·n
    from deinfer_megatron.decompose.allocation import uniform_rank

    spent = sum(ranks[n] * sum(s) if n in ranks else s[0] * s[1] for n, s in shapes.items())
    assert spent <= sum(uniform_rank(*s, 0.6) * sum(s) for s in shapes.values())
    assert manifest["dense_matrices"] == len(shapes) - len(ranks)


@pytest.mark.parametrize("chat", [True, False], ids=["chat-template", "bos-only"])
def test_the_calibration_temperature_reaches_the_sampler(chat: bool, tmp_path: Path) -> None:
    """Near zero the sampler is greedy decoding (an independent reference: transformers' argmax
    generation; and no seed changes it); at 0.7 and 1.0 it differs from greedy and from each other."""
    import transformers
    from transformers import GenerationConfig

    from deinfer_megatron.decompose.calibration import self_dialogues, self_samples

    save_tiny_folder("qwen2", tmp_path / "dense")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "dense")
    if chat:
        def sample(t: float, seed: int = 3) -> torch.Tensor:
            return self_dialogues(model, tok, n=2, seq_len=48, seed=seed, temperature=t)
    else:
        def sample(t: float, seed: int = 3) -> torch.Tensor:
            return self_samples(model, model.config.bos_token_id, n=2, seq_len=24, seed=seed, temperature=t)
    cold, warm, hot = sample(1e-6), sample(0.7), sample(1.0)
    assert not torch.equal(warm, hot) and not torch.equal(warm, cold)
    assert torch.equal(cold, sample(1e-6, seed=4)) and not torch.equal(warm, sample(0.7, seed=4))
    if not chat:
        bos = model.config.bos_token_id
        start = torch.full((2, 1), bos)
        greedy = model.generate(start, attention_mask=torch.ones_like(start), generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=23, eos_token_id=None, pad_token_id=bos, bos_token_id=bos))
        assert torch.equal(cold, greedy)


def test_self_dialogues_follow_the_chat_template(tmp_path: Path) -> None:
    import transformers

    from deinfer_megatron.decompose.calibration import self_dialogues

    model = save_tiny_folder("llama", tmp_path / "m")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    ids = self_dialogues(model, tok, n=3, seq_len=40, seed=1)
    assert ids.shape == (3, 40)
    text = tok.decode(ids.flatten())
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\n" in text
    assert "<|im_start|>assistant\n" in text


def test_the_rendered_conversations_are_the_windows_calibration_reads(tmp_path: Path) -> None:
    """The demo saves ``self_conversations`` as one text file that decompose and heal read with
    ``--calib-text``: tokenised whole, the file gives exactly the stream ``self_dialogues`` cuts
    (same seed, same first round), and it holds at least the tokens asked for."""
    import transformers

    from deinfer_megatron.decompose.calibration import self_conversations, self_dialogues, text_windows

    model = save_tiny_folder("llama", tmp_path / "m")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    texts = self_conversations(model, tok, tokens=4 * 64, rows=4, seq_len=64, seed=2, temperature=0.7)
    (tmp_path / "c.txt").write_text("".join(texts))
    stream = [t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"]]
    assert len(stream) >= 4 * 64
    read = text_windows(tok, tmp_path / "c.txt", seq_len=64, max_tokens=4 * 64)
    assert torch.equal(read, torch.tensor(stream[: 4 * 64]).view(4, 64))
    assert torch.equal(read, self_dialogues(model, tok, n=4, seq_len=64, seed=2, temperature=0.7))


def test_greedy_answers_are_the_model_greedy_continuation_of_each_sampled_question(tmp_path: Path) -> None:
    """``answer_temperature=0``: the questions are sampled as before (same seed, same first
    round), each answer is transformers' greedy generation for that question's chat prompt
    alone, cut after the end token."""
    import transformers

    from deinfer_megatron.decompose.calibration import self_conversations

    model = save_tiny_folder("llama", tmp_path / "m")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    sampled = self_conversations(model, tok, tokens=1, rows=3, seq_len=24, seed=5, temperature=0.7)
    greedy = self_conversations(model, tok, tokens=1, rows=3, seq_len=24, seed=5, temperature=0.7,
                                answer_temperature=0)
    marker = "<|im_start|>assistant\n"
    assert [t.split(marker)[0] for t in greedy] == [t.split(marker)[0] for t in sampled]
    assert greedy != sampled
    for text in greedy:
        prompt = tok(text.split(marker)[0] + marker, add_special_tokens=False)["input_ids"]
        out = hf_greedy_alone(model, prompt, 24, tok.eos_token_id)
        out = out[:-1] if out[-1:] == [tok.eos_token_id] else out
        assert text == tok.decode(prompt) + tok.decode(out, skip_special_tokens=True) + tok.eos_token + "\n"


def test_greedy_calibration_answers_reach_the_decomposition(tmp_path: Path) -> None:
    """``--calib-answers greedy``: the windows decompose calibrates on are the conversations whose
    answers are greedy (the stream ``self_conversations(answer_temperature=0)`` renders — the
    test above checks those answers against transformers), not the sampled ones; the manifest
    records it, and a model with no chat template is refused in one line."""
    import transformers

    from deinfer_megatron.arch.model import load_arch
    from deinfer_megatron.decompose.calibration import self_conversations
    from deinfer_megatron.decompose.job import _calibration

    save_tiny_folder("qwen2", tmp_path / "dense")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "dense")
    job = DecomposeJob(tmp_path / "dense", "svd-llm", ratio=0.6, calib_self=2, calib_seq_len=96,
                       calib_temperature=0.7, calib_answers="greedy", seed=4)  # windows long enough to answer
    ids, made = _calibration(job, model, tmp_path / "dense", load_arch(tmp_path / "dense"))
    texts = self_conversations(model, tok, tokens=192, rows=2, seq_len=96, seed=4, temperature=0.7,
                               answer_temperature=0)
    stream = [t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"]]
    assert torch.equal(ids, torch.tensor(stream[:192]).view(2, 96))
    sampled, _ = _calibration(DecomposeJob(**{**job.__dict__, "calib_answers": "sampled"}), model,
                              tmp_path / "dense", load_arch(tmp_path / "dense"))
    assert not torch.equal(ids, sampled)
    assert made == {"source": "self-dialogues:2", "tokens": 192, "seq_len": 96, "temperature": 0.7,
                    "answers": "greedy"}
    bare = tmp_path / "bare"
    bare.mkdir()  # config and weights, no tokenizer: nothing to answer in
    with pytest.raises(ValueError, match="--calib-answers greedy needs a chat model"):
        _calibration(job, model, bare, load_arch(tmp_path / "dense"))
