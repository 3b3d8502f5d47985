"""Convert a llama.cpp GGUF checkpoint (LLaMA architecture) into a plain Hugging Face folder.

Why our own code: the rest of the project works on float32 Hugging Face LLaMA weights, and the
only model we can ship offline is a quantized GGUF. ``gguf.GGUFReader`` is used purely as a file
parser (metadata fields and raw tensor bytes); dequantization, the Q/K row un-permutation, the
name mapping, config and tokenizer rebuilding are done here, so they are tested against
independent references (``gguf.quants`` and transformers' own GGUF loader) rather than trusted.

Output folder: ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, HF
LLaMA names), ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and,
written last, ``gguf_manifest.json`` (size and SHA-256 of every file; its presence means the
folder is complete, and loading checks the files against it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from deinfer_megatron.checkpoints.gguf_tokenizer import tokenizer_files
from deinfer_megatron.files.checksums import sha256
from deinfer_megatron.files.staging import staged_folder

MANIFEST_NAME = "gguf_manifest.json"
CONVERTER_VERSION = 2  # 2: the manifest records SHA-256 as well as sizes
SUPPORTED_ARCHITECTURES = ("llama",)

# ggml tensor type ids (ggml.h, enum ggml_type) -> (elements per block, bytes per block).
GGML_F32, GGML_F16, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 3, 8, 30
_BLOCK = {GGML_F32: (1, 4), GGML_F16: (1, 2), GGML_Q4_1: (32, 20), GGML_Q8_0: (32, 34), GGML_BF16: (1, 2)}
_TYPE_NAMES = {GGML_F32: "F32", GGML_F16: "F16", GGML_Q4_1: "Q4_1", GGML_Q8_0: "Q8_0", GGML_BF16: "BF16"}

# GGUF tensor name -> Hugging Face LlamaForCausalLM parameter name (one declarative table).
TENSOR_NAME_TABLE: dict[str, str] = {
    r"token_embd\.weight": "model.embed_tokens.weight",
    r"output_norm\.weight": "model.norm.weight",
    r"output\.weight": "lm_head.weight",
    r"blk\.(\d+)\.attn_norm\.weight": "model.layers.{}.input_layernorm.weight",
    r"blk\.(\d+)\.attn_q\.weight": "model.layers.{}.self_attn.q_proj.weight",
    r"blk\.(\d+)\.attn_k\.weight": "model.layers.{}.self_attn.k_proj.weight",
    r"blk\.(\d+)\.attn_v\.weight": "model.layers.{}.self_attn.v_proj.weight",
    r"blk\.(\d+)\.attn_output\.weight": "model.layers.{}.self_attn.o_proj.weight",
    r"blk\.(\d+)\.ffn_norm\.weight": "model.layers.{}.post_attention_layernorm.weight",
    r"blk\.(\d+)\.ffn_gate\.weight": "model.layers.{}.mlp.gate_proj.weight",
    r"blk\.(\d+)\.ffn_up\.weight": "model.layers.{}.mlp.up_proj.weight",
    r"blk\.(\d+)\.ffn_down\.weight": "model.layers.{}.mlp.down_proj.weight",
}
_COMPILED_TABLE = [(re.compile(pattern), target) for pattern, target in TENSOR_NAME_TABLE.items()]


def hf_tensor_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its Hugging Face LLaMA name (ValueError if unknown)."""
    for pattern, target in _COMPILED_TABLE:
        match = pattern.fullmatch(gguf_name)
        if match:
            return target.format(*match.groups())
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}; supported: LLaMA tensors {list(TENSOR_NAME_TABLE)}")


# ----------------------------------------------------------------------------- metadata


def _field_value(field: Any) -> Any:
    """Decode one ``gguf.ReaderField`` without relying on newer helpers (``contents()``)."""
    string_type, array_type = 8, 9  # GGUFValueType.STRING / ARRAY
    elem_type = int(field.types[-1]) if field.types else None

    def one(idx: int) -> Any:
        part = field.parts[idx]
        if elem_type == string_type:
            return bytes(part).decode("utf-8")
        value = part[0].item() if len(part) == 1 else part.tolist()
        return value

    if field.types and int(field.types[0]) == array_type:
        return [one(i) for i in field.data]
    return one(field.data[0])


def read_metadata(reader: Any) -> dict[str, Any]:
    """All GGUF key/value fields of a ``gguf.GGUFReader`` as plain Python values."""
    return {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _f32(value: float) -> float:
    """Shortest decimal that round-trips the stored float32 (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


# ----------------------------------------------------------------------------- dequantization


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (fp16 scale d, 32 x int8 q) -> flat float32 ``d * q``."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    return (q * d).reshape(-1)


def dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (fp16 d, fp16 m, 16 bytes of nibbles) -> flat float32 ``d * q + m``.

    Low nibbles hold elements 0..15 of the block and high nibbles elements 16..31 (not
    interleaved), which is why the two halves are concatenated rather than interleaved.
    """
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(-1)


_DEQUANTIZERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    GGML_F32: lambda raw: raw.view(np.float32).copy(),
    GGML_F16: lambda raw: raw.view(np.float16).astype(np.float32),
    GGML_BF16: lambda raw: (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32),
    GGML_Q4_1: dequantize_q4_1,
    GGML_Q8_0: dequantize_q8_0,
}


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw GGUF tensor bytes of ``ggml_type`` -> float32 array of torch-order ``shape``.

    ``shape`` is in torch order (slowest dim first), i.e. GGUF ``ne`` reversed.
    """
    ggml_type = int(ggml_type)
    if ggml_type not in _DEQUANTIZERS:
        names = ", ".join(_TYPE_NAMES.values())
        raise ValueError(f"unsupported GGUF tensor type id {ggml_type}; supported: {names}")
    flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    block_elems, block_bytes = _BLOCK[ggml_type]
    n = int(np.prod(shape))
    if n % block_elems or flat.size != n // block_elems * block_bytes:
        raise ValueError(f"{_TYPE_NAMES[ggml_type]} tensor of shape {shape} has {flat.size} bytes; layout mismatch")
    return _DEQUANTIZERS[ggml_type](flat).reshape(shape)


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE -> HF ``rotate_half`` halves).

    llama.cpp's converter reorders each head's rows from [x_0..x_{D/2-1}, y_0..y_{D/2-1}]
    to [x_0, y_0, x_1, y_1, ...] (``reshape(n_head, 2, D/2, ...).swapaxes(1, 2)``), because
    ggml's default RoPE rotates adjacent pairs. Hugging Face rotates the two halves, so GGUF row
    ``h*D + 2*j + k`` goes back to HF row ``h*D + k*D/2 + j``. ``n_head`` is the number of heads
    of this projection (KV heads for K).
    """
    rows = weight.shape[0]
    head_dim = rows // n_head
    if rows % n_head or head_dim % 2:
        raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
    w = weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(w.reshape(weight.shape))


# ----------------------------------------------------------------------------- config


def build_config(meta: dict[str, Any], vocab_size: int, tied: bool) -> dict[str, Any]:
    """HF ``LlamaConfig`` dict readable by transformers 4.57+ (``rope_theta``) and 5.x (``rope_parameters``)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {list(SUPPORTED_ARCHITECTURES)}")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"unsupported RoPE scaling {scaling!r}; supported: 'none'")
    hidden = int(meta[f"{arch}.embedding_length"])
    n_head = int(meta[f"{arch}.attention.head_count"])
    theta = _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    ctx = int(meta[f"{arch}.context_length"])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    pad = meta.get("tokenizer.ggml.padding_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(meta[f"{arch}.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": int(meta.get(f"{arch}.rope.dimension_count", hidden // n_head)),
        "hidden_act": "silu",
        "max_position_embeddings": ctx,
        "rms_norm_eps": _f32(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": bool(tied),
        "torch_dtype": "float32",
        "dtype": "float32",
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
    }


def build_generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """Minimal ``generation_config.json``: just the special ids, so ``generate`` stops at eos."""
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if config[key] is not None}


# ----------------------------------------------------------------------------- conversion


def read_hf_state_dict(gguf_path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a GGUF file into (metadata, float32 HF-named numpy state dict)."""
    from gguf import GGUFReader  # parser only; imported lazily so importing this module is cheap

    reader = GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {list(SUPPORTED_ARCHITECTURES)}")
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    state: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))  # GGUF ne[0] is the fastest dim
        weight = dequantize(tensor.data, int(tensor.tensor_type), shape)
        if name.endswith("q_proj.weight"):
            weight = unpermute_qk(weight, n_head)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_qk(weight, n_kv)
        state[name] = weight
    return meta, state


def _write_json(path: Path, payload: Any) -> None:
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert ``gguf_path`` into a Hugging Face folder at ``out_dir`` and return ``out_dir``.

    Everything is written into a hidden temporary sibling folder which replaces ``out_dir`` in
    one rename once complete (manifest last), so a crash never leaves a half-written
    ``out_dir``. The caller decides whether an existing ``out_dir`` may be replaced
    (``embedded.fetch_model`` claims it first).
    """
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    meta, state = read_hf_state_dict(gguf_path)
    arch = meta["general.architecture"]
    vocab_size = state["model.embed_tokens.weight"].shape[0]
    config = build_config(meta, vocab_size, tied="lm_head.weight" not in state)
    files = tokenizer_files(meta, config["max_position_embeddings"])

    with staged_folder(out_dir) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del state
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", build_generation_config(config))
        for file_name, payload in files.items():
            _write_json(tmp / file_name, payload)
        manifest = {
            "converter": __name__,
            "converter_version": CONVERTER_VERSION,
            "source": gguf_path.name,
            "source_size": gguf_path.stat().st_size,
            "architecture": arch,
            "files": {p.name: {"size": p.stat().st_size, "sha256": sha256(p)} for p in sorted(tmp.iterdir())},
        }
        _write_json(tmp / MANIFEST_NAME, manifest)
    return out_dir


def _manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((Path(folder) / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def converted_by_us(folder: Path) -> bool:
    """Whether ``folder`` holds this converter's manifest (complete or not, any version)."""
    manifest = _manifest(folder)
    return manifest is not None and manifest.get("converter") == __name__


def is_complete(folder: Path, gguf_path: Path | None = None) -> bool:
    """True if ``folder`` holds a finished conversion (manifest present, files intact).

    With ``gguf_path`` the manifest must also name a source of the same size, so a changed
    GGUF (package upgrade) triggers a reconversion.
    """
    manifest = _manifest(folder)
    if manifest is None or manifest.get("converter_version") != CONVERTER_VERSION:
        return False
    if gguf_path is not None and manifest.get("source_size") != Path(gguf_path).stat().st_size:
        return False
    files = manifest.get("files", {})
    return bool(files) and all(
        (Path(folder) / name).is_file() and (Path(folder) / name).stat().st_size == entry["size"]
        for name, entry in files.items()
    )
