"""Read a Megatron-LM / Megatron-Core ``GPTModel`` checkpoint into Hugging Face form.

Users who train with Megatron decompose and serve their model through the Hugging Face path of
this project, so a checkpoint is turned into a ``config.json`` dict and float32 LLaMA/Qwen2
tensors. Two formats are read:

- ``torch`` (Megatron-LM's legacy ``--ckpt-format torch``): one ``model_optim_rng.pt`` per
  model-parallel rank, ``iter_NNNNNNN/mp_rank_TT[_PPP]/``. The shards are merged here with
  Megatron's layouts: fused QKV rows are the query groups ``[q heads of g; k_g; v_g]`` in order
  (also when there are fewer groups than TP ranks), each rank's gated fc1 is ``[gate_r; up_r]``,
  row-parallel weights split their input dimension, the vocabulary splits rows.
- ``dist`` (Megatron-Core ``dist_checkpointing``, ``--ckpt-format torch_dist``): PyTorch
  Distributed Checkpoint files holding every tensor under its *global* shape, independent of
  TP/PP (Megatron's sharding factories wrote the dense ``[gate; up]`` fc1). They are read in this
  process with no process group (``dcp.read_dcp_tensors``) — a file reader starts no
  distributed world — and Megatron's key conventions are undone here: stacked layers, per-layer
  keys, fc1 ``_w``/``_v`` halves, Transformer Engine norm names.

Both give one dense Megatron state dict (local-spec names, global layer numbers), which
``megatron_layout.megatron_to_hf`` converts with the layouts the shard loaders use and the
names of the ``hf_names`` table.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from deinfer_megatron.checkpoints.megatron_args import (
    arch_from_megatron_args,
    check_checkpoint_version,
    hf_config,
    load_pickle,
)
from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.checkpoints.dcp import read_dcp_tensors
from deinfer_megatron.checkpoints.dist_checkpoint import is_dist_checkpoint, open_checkpoint
from deinfer_megatron.checkpoints.megatron_layout import gated_rows, megatron_shapes, megatron_to_hf
from deinfer_megatron.parallel.topology import Span

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# Transformer Engine fuses each pre-norm into the following linear; local specs keep a module.
_TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
__all__ = ["detect_megatron_checkpoint", "megatron_to_hf", "read_megatron_checkpoint"]
_MODEL_KEYS = ("embedding.", "decoder.", "output_layer.")  # GPTModel's own tensors (not optimizer.*)
_EXPECTED = "a Megatron checkpoint folder: latest_checkpointed_iteration.txt + iter_NNNNNNN/ holding " \
    f"mp_rank_XX[_YYY]/{MODEL_FILE} (torch) or metadata.json + common.pt + *.distcp (torch_dist)"


def _iteration_dir(path: Path) -> Path:
    """The folder of the iteration the tracker names, or ``path`` itself."""
    tracker = path / TRACKER
    if not tracker.is_file():
        return path
    text = tracker.read_text().strip()
    if text == "release":
        return path / "release"
    if not text.isdigit():
        raise ValueError(f"{tracker} should hold an iteration number or 'release', not {text!r}")
    return path / f"iter_{int(text):07d}"


def _rank_files(folder: Path) -> dict[tuple[int, int], Path]:
    """``(tp_rank, pp_rank) → model_optim_rng.pt`` of a torch-format iteration folder."""
    out = {}
    for sub in folder.iterdir() if folder.is_dir() else ():
        m = _RANK_DIR.fullmatch(sub.name)
        if m and (sub / MODEL_FILE).is_file():
            if m.group(3):
                raise ValueError(f"{sub} is an expert-parallel shard; MoE models are not supported")
            out[(int(m.group(1)), int(m.group(2) or 0))] = sub / MODEL_FILE
    return out


def tokenizer_folder(path: Path) -> Path | None:
    """The folder holding a Megatron checkpoint's Hugging Face tokenizer: the root of one
    written by ``convert --to megatron`` (which copies it there), else None."""

    return Path(path) if is_dist_checkpoint(path) else None


def detect_megatron_checkpoint(path: Path) -> str | None:
    """``"torch"``, ``"dist"`` or None: which Megatron format ``path`` holds (root or iteration)."""
    path = Path(path)
    if not path.is_dir():
        return None
    try:
        folder = _iteration_dir(path)
    except ValueError:
        return None
    if (folder / "metadata.json").is_file() and (folder / "common.pt").is_file():
        return "dist"
    return "torch" if any(folder.glob(f"mp_rank_*/{MODEL_FILE}")) else None


def read_megatron_checkpoint(path: Path, *, vocab_size: int | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a Megatron ``GPTModel`` checkpoint as a Hugging Face config and float32 state dict.

    Args:
        path: the checkpoint root (with ``latest_checkpointed_iteration.txt``) or one iteration
            folder (``iter_NNNNNNN``/``release``).
        vocab_size: real vocabulary size (e.g. the tokenizer's length): Megatron pads the
            vocabulary and these padding rows are dropped. Default: keep every padded row.
    Returns:
        ``(config, state_dict)``: a LLaMA (or Qwen2, when QKV has a bias) ``config.json`` dict
        and tensors under Hugging Face names; no ``lm_head.weight`` when embeddings are tied.
    Raises:
        FileNotFoundError: not a checkpoint, or rank files missing.
        ValueError: an architecture or layout this reader does not support.
    """
    path = Path(path)

    if is_dist_checkpoint(path):  # written by `convert --to megatron`: verified, configs beside it
        arch, rank_config, _, tensors = open_checkpoint(path)
        if rank_config.modules:
            raise ValueError(f"{path} is a decomposed model; pass the dense model it came from")
        return json.loads((path / "config.json").read_text()), tensors  # its vocabulary is config.json's
    kind = detect_megatron_checkpoint(path)
    folder = _iteration_dir(path) if path.is_dir() else path
    if kind is None:
        if path.is_dir() and folder != path and not folder.is_dir():
            raise FileNotFoundError(
                f"{path / TRACKER} names {folder.name}, which does not exist; pass an existing iteration folder"
            )
        raise FileNotFoundError(f"{path} is not a Megatron checkpoint; expected {_EXPECTED}")
    arch, dense = _read_torch(folder) if kind == "torch" else _read_dist(folder)
    padded = arch.vocab_size
    vocab = padded if vocab_size is None else int(vocab_size)
    if not 0 < vocab <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be between 1 and the checkpoint's padded vocabulary ({padded})")
    arch = dataclasses.replace(arch, vocab_size=vocab)
    return hf_config(arch), megatron_to_hf(dense, arch)


def _checked_arch(state: Any, where: Path) -> ModelArch:
    """The architecture from a checkpoint's ``args`` (vocabulary filled in later)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{where} is not a Megatron-LM checkpoint (no state dict)")
    arch = arch_from_megatron_args(state.get("args"), 1, where)
    check_checkpoint_version(state.get("checkpoint_version"), where)
    return arch


# --- torch format: merge the model-parallel shards -------------------------------------------------

def _shard_rule(name: str) -> str:
    """How the TP ranks of Megatron parameter ``name`` (local-spec name) combine."""
    if name.endswith(("_extra_state", "inv_freq")):
        return "skip"
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        return "rows"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    if name.endswith("linear_fc1.weight"):
        return "gated"
    if name.endswith(("layernorm.weight",)):
        return "same"
    raise ValueError(f"unexpected tensor '{name}' in the Megatron checkpoint; a model with it is not supported")


def _global_name(key: str, layer_offset: int) -> str:
    """A stage's parameter name with the global layer number and local-spec norm names."""
    m = _LAYER.fullmatch(key)
    if m is None:
        return key
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{_TE_NORMS.get(m.group(2), m.group(2))}"


def _merge_tp(shards: list[Mapping[str, Any]], layer_offset: int) -> dict[str, torch.Tensor]:
    """One pipeline stage's TP shards → dense tensors with global layer numbers."""
    if any(set(s) != set(shards[0]) for s in shards):
        raise ValueError(f"the TP ranks of the pipeline stage from layer {layer_offset} hold different tensors")
    out: dict[str, torch.Tensor] = {}
    for key in shards[0]:
        name = _global_name(key, layer_offset)
        rule = _shard_rule(name)
        if rule == "skip":
            continue
        parts = [s[key] for s in shards]
        if rule == "rows":
            out[name] = torch.cat(parts, 0)
        elif rule == "cols":
            out[name] = torch.cat(parts, 1)
        elif rule == "gated":
            out[name] = _merge_gated(parts)
        else:
            out[name] = parts[0].clone()  # replicated; a copy frees the memory-mapped file
    return out


def _merge_gated(parts: list[torch.Tensor]) -> torch.Tensor:
    """The TP ranks' gated fc1 shards (each ``[gate_r; up_r]``) → the dense ``[gate; up]``."""
    size = sum(p.shape[0] for p in parts) // 2
    merged = parts[0].new_empty((2 * size, *parts[0].shape[1:]))
    start = 0
    for part in parts:
        span = Span(size, start, start + part.shape[0] // 2)
        for shard in (0, 1):
            rank_rows, hf_rows = gated_rows(span, shard)
            dense_rows, _ = gated_rows(Span.whole(size), shard)
            merged[dense_rows.start + hf_rows.start : dense_rows.start + hf_rows.stop] = part[rank_rows]
        start = span.stop
    return merged


def _model_of(ckpt: Any, file: Path) -> Mapping[str, Any]:
    if not isinstance(ckpt, Mapping):
        raise ValueError(f"{file} is not a Megatron-LM checkpoint (no state dict)")
    if "model" not in ckpt and any(re.fullmatch(r"model\d+", str(k)) for k in ckpt):
        raise ValueError(
            f"{file} was saved with virtual pipeline parallelism (model0, model1, ...), which is not "
            "supported; re-save it with --ckpt-format torch_dist (independent of the parallel layout)"
        )
    model = ckpt.get("model")
    if not isinstance(model, Mapping):
        raise ValueError(f"{file} holds no 'model' state dict; pass a Megatron-LM model checkpoint")
    if any(str(k).startswith("language_model.") for k in model):
        raise ValueError(
            f"{file} holds a legacy Megatron-LM model (--use-legacy-models); only Megatron-Core "
            "GPTModel checkpoints are supported"
        )
    return model


def _read_torch(folder: Path) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    files = _rank_files(folder)
    first = load_pickle(files[min(files)])
    arch = _checked_arch(first, files[min(files)])
    args = first["args"]
    if (getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1:
        raise ValueError(
            f"{folder} was saved with virtual pipeline parallelism, which is not supported; re-save it "
            "with --ckpt-format torch_dist (independent of the parallel layout)"
        )
    tp = int(getattr(args, "tensor_model_parallel_size", None) or 1 + max(t for t, _ in files))
    pp = int(getattr(args, "pipeline_model_parallel_size", None) or 1 + max(p for _, p in files))
    dense: dict[str, torch.Tensor] = {}
    offset = 0  # stages number their layers from 0; stage sizes may be uneven
    for p in range(pp):
        shards = []
        for t in range(tp):
            if (t, p) not in files:
                name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                raise FileNotFoundError(f"{folder / name / MODEL_FILE} is missing: the args say TP={tp}, PP={pp}")
            ckpt = first if (t, p) == min(files) else load_pickle(files[(t, p)])
            shards.append(_model_of(ckpt, files[(t, p)]))
        stage = _merge_tp(shards, offset)
        offset = 1 + max((int(m.group(1)) for k in stage if (m := _LAYER.fullmatch(k))), default=offset - 1)
        dense.update(stage)
    if "embedding.word_embeddings.weight" not in dense:
        raise ValueError(f"{folder} holds no embedding.word_embeddings.weight; it is not a GPTModel checkpoint")
    if offset != arch.num_layers:
        raise ValueError(f"{folder} holds {offset} layers but its args say num_layers={arch.num_layers}")
    padded = dense["embedding.word_embeddings.weight"].shape[0]
    return dataclasses.replace(arch, vocab_size=padded), dense


# --- dist format: PyTorch Distributed Checkpoint files read in this process ---------------------

def _read_dist(folder: Path) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    meta = json.loads((folder / "metadata.json").read_text())
    if meta.get("sharded_backend") != "torch_dist":
        raise ValueError(
            f"{folder} is a '{meta.get('sharded_backend')}' distributed checkpoint; only 'torch_dist' is "
            "supported (convert it with Megatron-LM's --ckpt-format torch_dist)"
        )
    arch = _checked_arch(load_pickle(folder / "common.pt"), folder)
    dense = _unstacked(read_dcp_tensors(folder, _MODEL_KEYS), arch, folder)
    if "embedding.word_embeddings.weight" not in dense:
        raise ValueError(f"{folder} holds no embedding.word_embeddings.weight; it is not a GPTModel checkpoint")
    arch = dataclasses.replace(arch, vocab_size=dense["embedding.word_embeddings.weight"].shape[0])
    _check_shapes(dense, arch, folder)
    return arch, dense


def _unstacked(saved: Mapping[str, torch.Tensor], arch: ModelArch, folder: Path) -> dict[str, torch.Tensor]:
    """Megatron's dist-checkpoint keys → dense local-spec names with global layer numbers.

    Layers are saved either stacked (``decoder.layers.<name>``, the layer as the first axis: the
    default) or one key per layer (``decoder.layers.<i>.<name>``); a gated fc1 as one tensor
    ``[gate; up]`` or as ``weight_w`` (gate) and ``weight_v`` (up) halves
    (``singleton_local_shards``); norms under Transformer Engine's fused names or the local
    spec's (see ``_TE_NORMS``)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in saved.items():
        if _LAYER.fullmatch(key) or not key.startswith("decoder.layers."):
            out[_global_name(key, 0)] = tensor
            continue
        if tensor.shape[0] != arch.num_layers:
            raise ValueError(f"{folder} holds {tensor.shape[0]} layers of '{key}' but its args say "
                             f"num_layers={arch.num_layers}")
        rest = key.removeprefix("decoder.layers.")
        for i, layer in enumerate(tensor.unbind(0)):  # copies: a layer owns its memory
            out[_global_name(f"decoder.layers.{i}.{rest}", 0)] = layer.clone()
    for name in [n for n in out if n.endswith(("_w", "_v"))]:
        base = name[:-2]
        if base.endswith(".linear_fc1.weight") and name in out:
            gate, up = out.pop(f"{base}_w", None), out.pop(f"{base}_v", None)
            if gate is None or up is None:
                raise ValueError(f"{folder} holds only one half of '{base}' (weight_w/weight_v); the checkpoint "
                                 "is incomplete")
            out[base] = torch.cat([gate, up])
    return out


def _check_shapes(dense: Mapping[str, torch.Tensor], arch: ModelArch, folder: Path) -> None:
    """Every tensor the args imply is there, with the shape they imply."""
    shapes = megatron_shapes(arch)
    missing = sorted(n for n, (_, required) in shapes.items() if required and n not in dense)
    if missing:
        raise ValueError(f"{folder} lacks tensors its args imply, e.g. {missing[:3]}; it does not match its own args")
    wrong = [f"'{n}' has shape {tuple(dense[n].shape)}, its args imply {shape}"
             for n, (shape, _) in shapes.items() if n in dense and tuple(dense[n].shape) != shape]
    if wrong:
        raise ValueError(f"{folder}: {'; '.join(wrong[:3])}; the checkpoint does not match its own args")
