"""The one table from Hugging Face parameter names to ours (Megatron ``GPTModel`` names).

A dense Hugging Face matrix is ``<module>.weight``; a decomposed one is ``<module>.u`` (U, out
× r) and ``<module>.v`` (V, r × in), as written by ``deinfer-megatron decompose``. Each name maps
to one of our parameters and a *shard id*: which piece of a fused parameter it fills (q/k/v of
Megatron's fused QKV, gate/up of a gated fc1, or a section of a merged factor). The parameter's
own ``weight_loader`` knows where that piece goes on this rank.

The tables are keyed by a family's ``ModelFamily.hf_names`` (Qwen2 uses LLaMA's names); the
projections' module names come from the family record itself (``ModelArch.attention_modules``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from deinfer_megatron.arch.family import ModelFamily
from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.specs.rank_config import RankConfig

# Global (not per-layer) parameters: Hugging Face name → ours, by ``ModelFamily.hf_names``.
_GLOBAL = {
    "llama": {
        "model.embed_tokens.weight": "embedding.word_embeddings.weight",
        "model.norm.weight": "decoder.final_layernorm.weight",
        "lm_head.weight": "output_layer.weight",
    },
    "opt": {
        "model.decoder.embed_tokens.weight": "embedding.word_embeddings.weight",
        "model.decoder.embed_positions.weight": "embedding.position_embeddings.weight",
        "model.decoder.final_layer_norm.weight": "decoder.final_layernorm.weight",
        "model.decoder.final_layer_norm.bias": "decoder.final_layernorm.bias",
        "lm_head.weight": "output_layer.weight",
    },
}

# Per-layer norms: suffix after "<layer prefix>.<i>." → ours after "decoder.layers.<i>.", by ``hf_names``.
_NORMS = {
    "llama": {
        "input_layernorm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    },
    "opt": {
        "self_attn_layer_norm.weight": "input_layernorm.weight",
        "self_attn_layer_norm.bias": "input_layernorm.bias",
        "final_layer_norm.weight": "pre_mlp_layernorm.weight",
        "final_layer_norm.bias": "pre_mlp_layernorm.bias",
    },
}

# Our global parameters that other modules look up by their role (``hf_global_name``).
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"

# Per-matrix targets: role → {suffix: (our name, shard id)} for dense and decomposed blocks.
_QKV_INDEX = {"q": 0, "k": 1, "v": 2}
_FC1_INDEX = {"gate": 0, "up": 1, "fc1": 0}


def _dense_target(role: str) -> tuple[str, object]:
    if role in _QKV_INDEX:
        return "self_attention.linear_qkv", role
    if role == "o":
        return "self_attention.linear_proj", None
    if role in _FC1_INDEX:
        return "mlp.linear_fc1", _FC1_INDEX[role]
    return "mlp.linear_fc2", None


def _factored_target(role: str, suffix: str) -> tuple[str, int]:
    if role in _QKV_INDEX:
        if suffix == "v":
            return "self_attention.linear_qkv_down.weight", _QKV_INDEX[role]
        return f"self_attention.linear_{role}_up.{'weight' if suffix == 'u' else 'bias'}", 0
    module = {"o": "self_attention.linear_proj", "down": "mlp.linear_fc2", "fc2": "mlp.linear_fc2"}.get(
        role, "mlp.linear_fc1"
    )
    shard = _FC1_INDEX.get(role, 0)
    part = {"v": "down.weight", "u": "up.weight", "bias": "up.bias"}[suffix]
    return f"{module}.{part}", shard


@dataclass(frozen=True)
class Target:
    """Where one Hugging Face tensor goes: our parameter, its shard id, and its layer."""

    name: str  # ours, with the *global* layer index
    shard: object
    layer: int | None  # global 0-based layer index, None for embeddings/final norm/head


class NameMap:
    """Maps Hugging Face names of one model (given its rank config) to ``Target``s."""

    def __init__(self, arch: ModelArch, rank_config: RankConfig) -> None:
        self.arch = arch
        self.rank_config = rank_config
        prefix = re.escape(arch.layer_prefix)
        self._layer_re = re.compile(rf"^{prefix}\.(\d+)\.(.+)$")
        self._roles: dict[str, str] = {}
        for layer in range(arch.num_layers):
            for role, module in {**arch.attention_modules(layer), **arch.mlp_modules(layer)}.items():
                self._roles[module] = role

    def target(self, hf_name: str) -> Target | None:
        """The target of ``hf_name``, or None when the name is not part of the model."""
        glob = global_names(self.arch.model_family).get(hf_name)
        if glob is not None:
            return Target(glob, None, None)
        m = self._layer_re.match(hf_name)
        if not m:
            return None
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= self.arch.num_layers:
            return None
        norm = norm_names(self.arch.model_family).get(rest)
        if norm is not None:
            return Target(f"decoder.layers.{layer}.{norm}", None, layer)
        module, _, suffix = hf_name.rpartition(".")
        role = self._roles.get(module)
        if role is None or suffix not in ("weight", "bias", "u", "v"):
            return None
        decomposed = module in self.rank_config.modules
        if decomposed and suffix == "weight":
            raise ValueError(
                f"'{hf_name}' is a dense weight but the rank config decomposes '{module}'; "
                "the checkpoint and its rank_config.json disagree"
            )
        if not decomposed and suffix in ("u", "v"):
            raise ValueError(
                f"'{hf_name}' is a low-rank factor but the rank config keeps '{module}' dense; "
                "the checkpoint and its rank_config.json disagree"
            )
        if decomposed:
            name, shard = _factored_target(role, suffix)
        else:
            base, shard = _dense_target(role)
            name = f"{base}.{suffix}"
        return Target(f"decoder.layers.{layer}.{name}", shard, layer)


def expected_shapes(arch: ModelArch, rank_config: RankConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every Hugging Face tensor of the model → ``(shape, required)``, as config.json and the
    rank config imply. Decomposed matrices appear as ``.u`` (out × r) and ``.v`` (r × in); a
    tied output layer (``lm_head.weight``) may be absent."""
    h, fam = arch.hidden_size, arch.model_family
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    for name, ours in global_names(fam).items():
        if ours == POSITION_EMBEDDINGS:  # learned positions, after the family's offset rows
            out[name] = ((arch.max_positions + fam.position_offset, h), True)
        else:
            out[name] = ((h,), True)
    out[embedding_name(arch)] = ((arch.vocab_size, h), True)
    out["lm_head.weight"] = ((arch.vocab_size, h), not arch.tied_embeddings)
    shapes = arch.linear_shapes()
    for layer in range(arch.num_layers):
        for suffix in norm_names(fam):
            out[f"{arch.layer_prefix}.{layer}.{suffix}"] = ((h,), True)
        roles = {**arch.attention_modules(layer), **arch.mlp_modules(layer)}
        for role, module in roles.items():
            rows, cols = shapes[module]
            rank = rank_config.modules.get(module)
            if rank is None:
                out[f"{module}.weight"] = ((rows, cols), True)
            else:
                out[f"{module}.u"] = ((rows, rank), True)
                out[f"{module}.v"] = ((rank, cols), True)
            if arch.linear_bias or (arch.qkv_bias and role in _QKV_INDEX):
                out[f"{module}.bias"] = ((rows,), True)
    return out


def global_names(family: ModelFamily) -> dict[str, str]:
    """The family's global tensors: Hugging Face name → ours."""
    return _GLOBAL[family.hf_names]


def norm_names(family: ModelFamily) -> dict[str, str]:
    """The family's per-layer norm tensors: suffix after ``<layer prefix>.<i>.`` → ours."""
    return _NORMS[family.hf_names]


def hf_global_name(family: ModelFamily, ours: str) -> str | None:
    """The Hugging Face name of our global parameter ``ours`` in ``family``; None if it has none."""
    return next((hf for hf, o in global_names(family).items() if o == ours), None)


def embedding_name(arch: ModelArch) -> str:
    """The Hugging Face name of the token embedding (also the tied output layer's weight)."""
    name = hf_global_name(arch.model_family, WORD_EMBEDDINGS)
    assert name is not None, f"hf_names has no token embedding for {arch.family}"
    return name
