"""Read a Megatron-LM / Megatron-Core ``GPTModel`` checkpoint into Hugging Face form.

Users who train with Megatron decompose and serve their model through the Hugging Face path of
this project, so a checkpoint is turned into a ``config.json`` dict and float32 LLaMA/Qwen2
tensors. Two formats are read:

- ``torch`` (Megatron-LM's legacy ``--ckpt-format torch``): one ``model_optim_rng.pt`` per
  model-parallel rank, ``iter_NNNNNNN/mp_rank_TT[_PPP]/``. The shards are merged here with
  Megatron's layouts: fused QKV rows are the query groups ``[q heads of g; k_g; v_g]`` in order
  (also when there are fewer groups than TP ranks), each rank's gated fc1 is ``[gate_r; up_r]``,
  row-parallel weights split their input dimension, the vocabulary splits rows.
- ``dist`` (Megatron-Core ``dist_checkpointing``, ``--ckpt-format torch_dist``): the checkpoint
  is independent of TP/PP, so a dense single-process ``GPTModel`` (Megatron's local spec) is
  built and ``dist_checkpointing.load`` fills it; Megatron's own sharding factories undo the
  layouts.

Both give one dense Megatron state dict (local-spec names, global layer numbers), which
``megatron_to_hf`` converts by a pure name/slice table.
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
    pickle_allowlist,
)
from deinfer_megatron.arch.model import ModelArch, transformer_config

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# Transformer Engine fuses each pre-norm into the following linear; local specs keep a module.
_TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
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
        elif rule == "gated":  # each rank holds [gate_r; up_r] (Megatron stride 2)
            halves = [p.chunk(2, 0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
        else:
            out[name] = parts[0].clone()  # replicated; a copy frees the memory-mapped file
    return out


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


# --- dist format: dist_checkpointing.load into a dense single-process GPTModel -------------------

def _read_dist(folder: Path) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    meta = json.loads((folder / "metadata.json").read_text())
    if meta.get("sharded_backend") != "torch_dist":
        raise ValueError(
            f"{folder} is a '{meta.get('sharded_backend')}' distributed checkpoint; only 'torch_dist' is "
            "supported (convert it with Megatron-LM's --ckpt-convert-format torch_dist)"
        )
    arch = _checked_arch(load_pickle(folder / "common.pt"), folder)
    return _load_dist(folder, arch)


def _load_dist(folder: Path, arch: ModelArch) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """Run ``_load_dist_dense`` in a private one-rank gloo world (torch.distributed and
    Megatron's parallel state are torn down afterwards). Inside a running distributed job a
    private world cannot be made without the other ranks, so one child process does it."""
    import torch.distributed as dist

    if dist.is_initialized():
        from deinfer_megatron.launch.local import spawn_local

        return spawn_local(1, _load_dist, folder, arch)[0]
    from deinfer_megatron import patches

    patches.apply_all()
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        return _load_dist_dense(folder, arch)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _alternative_key(key: str, present: set[str]) -> str:
    """The checkpoint's name for ``key``: norms are saved under Transformer Engine's fused names
    by TE and by Megatron's local spec (its ``sharded_state_dict_keys_map``), under module names
    by specs without that map."""
    for te, local in _TE_NORMS.items():
        for a, b in ((te, local), (local, te)):
            if a in key and key.replace(a, b) in present:
                return key.replace(a, b)
    return key


def _load_dist_dense(folder: Path, arch: ModelArch) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    saved = dist_checkpointing.load_tensors_metadata(str(folder))
    if "embedding.word_embeddings.weight" not in saved:
        raise ValueError(f"{folder} holds no embedding.word_embeddings.weight; it is not a GPTModel checkpoint")
    padded = saved["embedding.word_embeddings.weight"].global_shape[0]
    with torch.device("meta"):
        model = GPTModel(
            transformer_config(arch, tp=1, pp=1),
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=padded,
            max_sequence_length=arch.max_positions,
            share_embeddings_and_output_weights=arch.tied_embeddings,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )
    model.to_empty(device="cpu")
    # How the layers were keyed when saved: one stacked tensor per parameter (default) or one
    # per layer; gated fc1 as one tensor or as separate _w/_v halves.
    metadata = {
        "non_homogeneous_layers": any(re.match(r"decoder\.layers\.\d+\.", k) for k in saved),
        "singleton_local_shards": any(k.endswith("linear_fc1.weight_w") for k in saved),
    }
    request = {k: v for k, v in model.sharded_state_dict(metadata=metadata).items() if not isinstance(v, ShardedObject)}
    present = set(saved)
    for value in request.values():
        if isinstance(value, ShardedTensor):
            value.key = _alternative_key(value.key, present)
    tensors = [v for v in request.values() if isinstance(v, ShardedTensor)]
    missing = sorted(v.key for v in tensors if v.key not in present)
    if missing:
        raise ValueError(f"{folder} lacks tensors its args imply, e.g. {missing[:3]}; it does not match its own args")
    for v in tensors:
        if tuple(saved[v.key].global_shape) != tuple(v.global_shape) and not v.allow_shape_mismatch:
            raise ValueError(f"{folder}: '{v.key}' has shape {tuple(saved[v.key].global_shape)}, its args imply "
                             f"{tuple(v.global_shape)}; the checkpoint does not match its own args")
    with torch.serialization.safe_globals(pickle_allowlist(folder / "common.pt")):
        loaded = dist_checkpointing.load(request, str(folder))
    return dataclasses.replace(arch, vocab_size=padded), {k: loaded[k] for k in request}


# --- dense Megatron names → Hugging Face names -----------------------------------------------------

def megatron_to_hf(dense: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """A dense (TP=1) Megatron ``GPTModel`` state dict → Hugging Face LLaMA/Qwen2 tensors (float32).

    The vocabulary is cut to ``arch.vocab_size`` rows; an ``output_layer.weight`` of a tied
    model (a pipeline copy of the embedding) is dropped.
    """
    src = dict(dense)

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise ValueError(f"the checkpoint lacks '{name}', which its args imply; it does not match its own args")
        return src.pop(name).to(torch.float32)

    d, per_group, groups = arch.head_dim, arch.num_heads // arch.num_kv_heads, arch.num_kv_heads
    v = arch.vocab_size
    out = {"model.embed_tokens.weight": take("embedding.word_embeddings.weight")[:v].clone()}
    for i in range(arch.num_layers):
        meg, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        for suffix in ("weight", "bias") if arch.qkv_bias else ("weight",):
            qkv = take(f"{meg}self_attention.linear_qkv.{suffix}")
            _check_rows(f"{meg}self_attention.linear_qkv.{suffix}", qkv, groups * (per_group + 2) * d)
            blocks = qkv.reshape(groups, (per_group + 2) * d, -1)
            q, k, val = blocks.split([per_group * d, d, d], 1)
            for role, t in (("q", q), ("k", k), ("v", val)):
                out[f"{hf}self_attn.{role}_proj.{suffix}"] = t.reshape(-1, *qkv.shape[1:]).clone()
        out[f"{hf}self_attn.o_proj.weight"] = take(f"{meg}self_attention.linear_proj.weight")
        fc1 = take(f"{meg}mlp.linear_fc1.weight")
        _check_rows(f"{meg}mlp.linear_fc1.weight", fc1, 2 * arch.ffn_hidden_size)
        gate, up = fc1.chunk(2, 0)
        out[f"{hf}mlp.gate_proj.weight"], out[f"{hf}mlp.up_proj.weight"] = gate.clone(), up.clone()
        out[f"{hf}mlp.down_proj.weight"] = take(f"{meg}mlp.linear_fc2.weight")
        out[f"{hf}input_layernorm.weight"] = take(f"{meg}input_layernorm.weight")
        out[f"{hf}post_attention_layernorm.weight"] = take(f"{meg}pre_mlp_layernorm.weight")
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if arch.tied_embeddings:
        src.pop("output_layer.weight", None)
    else:
        out["lm_head.weight"] = take("output_layer.weight")[:v].clone()
    if src:
        raise ValueError(f"the checkpoint has tensors its args do not explain, e.g. {sorted(src)[:3]}; check its args")
    for module, shape in arch.linear_shapes().items():
        if tuple(out[f"{module}.weight"].shape) != shape:
            got = tuple(out[f"{module}.weight"].shape)
            raise ValueError(f"{module}.weight has shape {got}, but the checkpoint's args imply {shape}")
    return out


def _check_rows(name: str, t: torch.Tensor, rows: int) -> None:
    if t.shape[0] != rows:
        raise ValueError(f"'{name}' has {t.shape[0]} rows but the args imply {rows}; the checkpoint contradicts them")
