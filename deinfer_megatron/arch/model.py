"""What the project needs to know about a Hugging Face model, read once from its config.

``ModelArch`` is the single description of a supported architecture (LLaMA, Qwen2, OPT): sizes,
norms, biases, positions, and the shapes of its linear matrices under Hugging Face names. It is
turned into a Megatron ``TransformerConfig`` by ``transformer_config``; nothing else in the
project reads a Hugging Face config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "opt": "OPTForCausalLM"}


@dataclass(frozen=True)
class ModelArch:
    """A supported decoder-only architecture and its sizes."""

    family: str  # "llama" | "qwen2" | "opt"
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

    @property
    def gated(self) -> bool:
        return self.family != "opt"

    @property
    def rotary(self) -> bool:
        """Positions by RoPE (the LLaMA/Qwen2 families); OPT learns absolute positions."""
        return self.family != "opt"

    @property
    def qkv_bias(self) -> bool:
        return self.family in ("qwen2", "opt")

    @property
    def linear_bias(self) -> bool:
        return self.family == "opt"

    @property
    def layer_prefix(self) -> str:
        return "model.decoder.layers" if self.family == "opt" else "model.layers"

    def attention_modules(self, layer: int) -> dict[str, str]:
        """Role (q, k, v, o) → Hugging Face module name."""
        base = f"{self.layer_prefix}.{layer}.self_attn"
        o = "out_proj" if self.family == "opt" else "o_proj"
        return {"q": f"{base}.q_proj", "k": f"{base}.k_proj", "v": f"{base}.v_proj", "o": f"{base}.{o}"}

    def mlp_modules(self, layer: int) -> dict[str, str]:
        """Role (gate, up, down — or fc1, fc2 for OPT) → Hugging Face module name."""
        base = f"{self.layer_prefix}.{layer}"
        if self.family == "opt":
            return {"fc1": f"{base}.fc1", "fc2": f"{base}.fc2"}
        return {r: f"{base}.mlp.{r}_proj" for r in ("gate", "up", "down")}

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


def _get(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    scaling = params.get("rope_type", params.get("type", "default"))
    if scaling not in ("default", None):
        raise ValueError(
            f"RoPE scaling '{scaling}' is not supported; only plain RoPE (rope_type 'default')"
        )
    return float(_get(cfg, "rope_theta", default=params.get("rope_theta", 10000.0)))


def _check_sizes(arch: "ModelArch") -> "ModelArch":
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "max_positions"):
        value = getattr(arch, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
    if arch.num_heads % arch.num_kv_heads:
        raise ValueError(f"{arch.num_heads} attention heads cannot share {arch.num_kv_heads} KV heads evenly")
    return arch


def arch_from_hf_config(cfg: Mapping[str, Any]) -> ModelArch:
    """Read a Hugging Face ``config.json`` mapping; unsupported architectures are a clear error."""
    return _check_sizes(_arch_from_hf_config(cfg))


def _arch_from_hf_config(cfg: Mapping[str, Any]) -> ModelArch:
    family = cfg.get("model_type")
    if family not in SUPPORTED:
        raise ValueError(
            f"unsupported architecture model_type={family!r}; supported: "
            + ", ".join(f"{k} ({v})" for k, v in SUPPORTED.items())
        )
    if family == "opt":
        if cfg.get("word_embed_proj_dim", cfg["hidden_size"]) != cfg["hidden_size"]:
            raise ValueError("OPT models with word_embed_proj_dim != hidden_size are not supported")
        if not cfg.get("do_layer_norm_before", True):
            raise ValueError("OPT models with post-layer-norm (do_layer_norm_before=false) are not supported")
        if cfg.get("activation_function", "relu") != "relu":
            raise ValueError("only ReLU OPT models are supported")
        heads = cfg["num_attention_heads"]
        return ModelArch(
            family="opt",
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["ffn_dim"],
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            max_positions=cfg["max_position_embeddings"],
            norm_eps=1e-5,
            rope_theta=0.0,
            tied_embeddings=cfg.get("tie_word_embeddings", True),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"only SiLU-gated MLPs are supported, got hidden_act={cfg.get('hidden_act')}")
    if family == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ValueError("LLaMA models with attention_bias/mlp_bias are not supported")
    heads = cfg["num_attention_heads"]
    return ModelArch(
        family=family,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_heads=heads,
        num_kv_heads=_get(cfg, "num_key_value_heads", default=heads),
        head_dim=_get(cfg, "head_dim", default=cfg["hidden_size"] // heads),
        vocab_size=cfg["vocab_size"],
        max_positions=cfg.get("max_position_embeddings", 2048),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
    )


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
    try:
        return arch_from_hf_config(cfg)
    except KeyError as err:
        raise ValueError(f"{path} lacks {err.args[0]!r}, which a {cfg.get('model_type')} config needs") from None
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def transformer_config(
    arch: ModelArch, *, tp: int, pp: int, dtype: torch.dtype = torch.float32
) -> Any:
    """The Megatron ``TransformerConfig`` for ``arch`` at the given parallel sizes.

    Fusions and dropouts are off (inference, and the CPU has no fused kernels); weights are
    never initialised (``perform_initialization=False``) because a checkpoint always follows.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    opt = arch.family == "opt"
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        normalization="LayerNorm" if opt else "RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=arch.gated,
        activation_func=F.relu if opt else F.silu,
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
