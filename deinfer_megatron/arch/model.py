"""What the project needs to know about a Hugging Face model, read once from its config.

``ModelArch`` is the single description of a model: its family (a key of ``family.FAMILIES``,
whose record says what differs between LLaMA, Qwen2 and OPT), sizes, norms, biases, positions,
and the shapes of its linear matrices under Hugging Face names. It is turned into a Megatron
``TransformerConfig`` by ``transformer_config``; nothing else in the project reads a Hugging
Face config. Reading one refuses, in one line, every setting the project cannot serve
(``refusals``), so a command stops before any rank starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from deinfer_megatron.arch.family import FAMILIES, ModelFamily, family_for_model_type
from deinfer_megatron.arch.refusals import refuse_unsupported, rope_theta


@dataclass(frozen=True)
class ModelArch:
    """A supported decoder-only architecture and its sizes."""

    family: str  # the key of its record in family.FAMILIES
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    norm_eps: float
    rope_theta: float
    tied_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; known: {', '.join(FAMILIES)}")

    @property
    def model_family(self) -> ModelFamily:
        """The record of this model's family: what its network computes, its Hugging Face names."""
        return FAMILIES[self.family]

    @property
    def gated(self) -> bool:
        return self.model_family.gated

    @property
    def rotary(self) -> bool:
        """Positions by RoPE (the LLaMA/Qwen2 families); OPT learns absolute positions."""
        return self.model_family.rotary

    @property
    def qkv_bias(self) -> bool:
        return self.model_family.qkv_bias

    @property
    def linear_bias(self) -> bool:
        return self.model_family.linear_bias

    @property
    def layer_prefix(self) -> str:
        return self.model_family.layer_prefix

    def attention_modules(self, layer: int) -> dict[str, str]:
        """Role (q, k, v, o) → Hugging Face module name."""
        return {role: f"{self.layer_prefix}.{layer}.{name}" for role, name in self.model_family.attention_names}

    def mlp_modules(self, layer: int) -> dict[str, str]:
        """Role (gate, up, down — or fc1, fc2 for OPT) → Hugging Face module name; the projections
        reading the layer's input first, the output projection last."""
        return {role: f"{self.layer_prefix}.{layer}.{name}" for role, name in self.model_family.mlp_names}

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Every decomposable matrix: Hugging Face module name → (out, in)."""
        h, i, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        role_shape = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q),
                      "gate": (i, h), "up": (i, h), "fc1": (i, h), "down": (h, i), "fc2": (h, i)}
        out: dict[str, tuple[int, int]] = {}
        for layer in range(self.num_layers):
            for role, name in {**self.attention_modules(layer), **self.mlp_modules(layer)}.items():
                out[name] = role_shape[role]
        return out


def _get(cfg: Mapping[str, Any], key: str | None, default: Any = None) -> Any:
    """``cfg[key]`` unless the family has no such key or it is absent or null."""
    if key is None or cfg.get(key) is None:
        return default
    return cfg[key]


def _check_sizes(arch: "ModelArch") -> "ModelArch":
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "max_positions"):
        value = getattr(arch, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
    if arch.num_heads % arch.num_kv_heads:
        raise ValueError(f"{arch.num_heads} attention heads cannot share {arch.num_kv_heads} KV heads evenly")
    return arch


def arch_from_hf_config(cfg: Mapping[str, Any], source: str = "config.json") -> ModelArch:
    """Read a Hugging Face ``config.json`` mapping (``source`` names it in errors).

    Raises:
        ValueError: one line — an unsupported ``model_type`` (listing the supported ones), a
            setting the project cannot serve (``refusals``), a missing key or a bad size.
    """
    try:
        return _arch_from_hf_config(cfg)
    except KeyError as err:
        raise ValueError(f"{source} lacks {err.args[0]!r}, which a {cfg.get('model_type')} config needs") from None
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def _arch_from_hf_config(cfg: Mapping[str, Any]) -> ModelArch:
    fam = family_for_model_type(cfg.get("model_type"))
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    max_positions = _get(cfg, "max_position_embeddings", fam.max_positions_default)
    if max_positions is None:
        raise KeyError("max_position_embeddings")
    arch = _check_sizes(ModelArch(
        family=fam.name,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=cfg[fam.ffn_key],
        num_heads=heads,
        num_kv_heads=_get(cfg, fam.kv_heads_key, heads),
        head_dim=_get(cfg, fam.head_dim_key, hidden // heads if _positive(heads) and _positive(hidden) else None),
        vocab_size=cfg["vocab_size"],
        max_positions=max_positions,
        norm_eps=float(_get(cfg, fam.norm_eps_key, fam.norm_eps_default)),
        rope_theta=rope_theta(cfg) if fam.rotary else 0.0,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", fam.tied_default)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
    ))
    refuse_unsupported(fam, cfg, arch.max_positions)
    return arch


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def load_arch(model_dir: str | Path) -> ModelArch:
    """Read ``config.json`` from a model folder; every problem with it is one error naming it."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        missing = "" if Path(model_dir).is_dir() else " (the folder does not exist)"
        raise FileNotFoundError(
            f"no config.json in {model_dir}{missing}: pass a Hugging Face model folder "
            "(or a folder written by `deinfer-megatron decompose`)"
        )
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object (a Hugging Face model config)")
    return arch_from_hf_config(cfg, source=str(path))


def transformer_config(
    arch: ModelArch, *, tp: int, pp: int, dtype: torch.dtype = torch.float32
) -> Any:
    """The Megatron ``TransformerConfig`` for ``arch`` at the given parallel sizes.

    Fusions and dropouts are off (inference, and the CPU has no fused kernels); weights are
    never initialised (``perform_initialization=False``) because a checkpoint always follows.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    fam = arch.model_family
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        normalization=fam.norm,
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=arch.gated,
        activation_func=fam.activation_func,
        add_bias_linear=arch.linear_bias,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
