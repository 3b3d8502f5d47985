"""What a Megatron-LM checkpoint says about its model, and how to read Megatron's pickles safely.

Megatron-LM stores the training run's argparse ``Namespace`` in every checkpoint
(``model_optim_rng.pt["args"]``, or ``common.pt["args"]`` for ``torch_dist``). It is the only
record of the architecture, so ``arch_from_megatron_args`` reads it into the project's
``ModelArch`` (LLaMA, or Qwen2 when the QKV projection has a bias) and refuses everything a
Hugging Face LLaMA/Qwen2 model cannot express. ``hf_config`` writes the matching ``config.json``.

Checkpoints also pickle objects we never need (optimizer and RNG state, enums, NumPy arrays,
Transformer Engine's extra state), some of classes that are not even installed here.
``load_pickle`` loads them with ``weights_only=True`` and stands an inert placeholder in for
every such class, so reading a checkpoint never runs code from it.
"""

from __future__ import annotations

import pickle
from argparse import Namespace
from pathlib import Path
from typing import Any

import torch

from deinfer_megatron.arch.family import FAMILIES, ModelFamily
from deinfer_megatron.arch.model import ModelArch

SUPPORTED = (
    "supported: LLaMA/Qwen2-style GPT models (RMSNorm, SwiGLU, RoPE over the whole head, "
    "no linear biases, optional QKV bias)"
)
CURRENT_CHECKPOINT_VERSION = 3.0  # what Megatron-LM's save_checkpoint has written since 2021


class Opaque:
    """Placeholder for a pickled object of a class the reader does not need."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "Opaque":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


def pickle_allowlist(path: Path) -> list[Any]:
    """``torch.serialization.safe_globals`` entries that let ``path`` load with ``weights_only``:
    ``argparse.Namespace`` for real, every other global torch does not allow an ``Opaque``."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except (pickle.UnpicklingError, RuntimeError, OSError) as err:
        raise ValueError(f"cannot read {path} as a torch checkpoint ({err}); is the file complete?") from err
    return [(Namespace, "argparse.Namespace")] + [(Opaque, n) for n in names if n != "argparse.Namespace"]


def load_pickle(path: Path) -> Any:
    """``torch.load`` a Megatron file on the CPU (memory-mapped) without executing pickled code."""
    allowed = pickle_allowlist(path)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, OSError) as err:
        raise ValueError(f"cannot read {path} as a torch checkpoint ({err}); is the file complete?") from err


def _arg(args: Namespace, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            return value
    return default


def _unsupported(args: Namespace) -> list[str]:
    """Every feature of ``args`` that a LLaMA/Qwen2 model cannot express."""
    norm = _arg(args, "normalization", default="LayerNorm")
    rope = _arg(args, "position_embedding_type",
                default="rope" if getattr(args, "use_rotary_position_embeddings", False) else "learned_absolute")
    checks = [
        (_arg(args, "num_experts"), f"MoE (num_experts={_arg(args, 'num_experts')})"),
        (getattr(args, "multi_latent_attention", False), "multi-latent attention"),
        (not getattr(args, "swiglu", False), "an MLP without SwiGLU (--swiglu not set)"),
        (norm != "RMSNorm", f"normalization={norm}"),
        (getattr(args, "apply_layernorm_1p", False), "zero-centred norms (--apply-layernorm-1p)"),
        (getattr(args, "qk_layernorm", False) or getattr(args, "qk_l2_norm", False), "QK normalisation"),
        (rope != "rope", f"position_embedding_type={rope}"),
        (float(_arg(args, "rotary_percent", default=1.0)) != 1.0,
         f"partial RoPE (rotary_percent={_arg(args, 'rotary_percent')})"),
        (getattr(args, "rotary_interleaved", False), "interleaved RoPE"),
        (getattr(args, "use_rope_scaling", False), "RoPE scaling (--use-rope-scaling)"),
        (_arg(args, "rotary_seq_len_interpolation_factor"), "RoPE position interpolation"),
        (_arg(args, "no_rope_freq"), "layers without RoPE (--no-rope-freq)"),
        (getattr(args, "add_bias_linear", True), "biases on linear layers (--add-bias-linear)"),
        (_arg(args, "window_size"), "sliding-window attention"),
        (_arg(args, "mtp_num_layers"), "multi-token prediction layers"),
        (getattr(args, "attention_output_gate", False), "gated attention output"),
        (_arg(args, "softmax_type", default="vanilla") != "vanilla", f"softmax_type={_arg(args, 'softmax_type')}"),
        (_arg(args, "hybrid_override_pattern", "heterogeneous_layers_config_path"), "hybrid/heterogeneous layers"),
    ]
    return [what for bad, what in checks if bad]


def check_checkpoint_version(version: Any, where: Path) -> None:
    """Megatron-Core ``GPTModel`` checkpoints are version 3.0; older ones have other layouts."""
    if version is None or float(version) < CURRENT_CHECKPOINT_VERSION:
        raise ValueError(
            f"{where} has checkpoint_version {version}, older than Megatron-Core's "
            f"{CURRENT_CHECKPOINT_VERSION}; load and re-save it with a current Megatron-LM first"
        )


def arch_from_megatron_args(args: Any, vocab_size: int, where: Path) -> ModelArch:
    """The architecture a Megatron-LM ``args`` Namespace describes (``vocab_size``: HF rows).

    Raises:
        ValueError: no args, or a model that is not LLaMA/Qwen2-shaped (one line: what and why).
    """
    if not isinstance(args, Namespace):
        raise ValueError(
            f"{where} holds no Megatron-LM 'args' to read the architecture from; "
            "save it with Megatron-LM's save_checkpoint (megatron/training/checkpointing.py)"
        )
    problems = _unsupported(args)
    if problems:
        raise ValueError(f"Megatron checkpoint {where} uses {', '.join(problems)}, which is not supported; {SUPPORTED}")
    missing = [n for n in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
               if getattr(args, n, None) is None]
    if missing:
        raise ValueError(f"the args saved in {where} lack {', '.join(missing)}; the checkpoint is incomplete")
    heads = int(args.num_attention_heads)
    gqa = getattr(args, "group_query_attention", False)
    groups = int(_arg(args, "num_query_groups", default=heads)) if gqa else heads
    max_positions = _arg(args, "max_position_embeddings", "seq_length")
    if max_positions is None:
        raise ValueError(f"the args saved in {where} give neither max_position_embeddings nor seq_length")
    return ModelArch(
        family=_family(bool(getattr(args, "add_qkv_bias", False))).name,
        num_layers=int(args.num_layers),
        hidden_size=int(args.hidden_size),
        ffn_hidden_size=int(args.ffn_hidden_size),
        num_heads=heads,
        num_kv_heads=groups,
        head_dim=int(_arg(args, "kv_channels", default=int(args.hidden_size) // heads)),
        vocab_size=vocab_size,
        max_positions=int(max_positions),
        norm_eps=float(_arg(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
        rope_theta=float(_arg(args, "rotary_base", default=10000)),
        tied_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
    )


def _family(qkv_bias: bool) -> ModelFamily:
    """The registry's family of a Megatron GPT model that ``_unsupported`` let through (RMSNorm,
    SwiGLU, RoPE, no linear biases), told apart by its QKV bias: LLaMA or Qwen2."""
    for fam in FAMILIES.values():
        if (fam.norm, fam.gated, fam.rotary, fam.linear_bias, fam.qkv_bias) == ("RMSNorm", True, True, False, qkv_bias):
            return fam
    raise AssertionError(f"no registered family is a Megatron GPT model with qkv_bias={qkv_bias}")


def hf_config(arch: ModelArch) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``arch`` (LLaMA or Qwen2: the families Megatron args
    describe), float32 weights."""
    fam = arch.model_family
    assert fam.kv_heads_key and fam.head_dim_key and fam.norm_eps_key, f"{fam.name} is not a Megatron GPT family"
    cfg: dict[str, Any] = {
        "architectures": [fam.hf_class],
        "model_type": fam.model_types[0],
        "hidden_size": arch.hidden_size,
        fam.ffn_key: arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        fam.kv_heads_key: arch.num_kv_heads,
        fam.head_dim_key: arch.head_dim,
        "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_positions,
        fam.norm_eps_key: arch.norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta},
        "tie_word_embeddings": arch.tied_embeddings,
        fam.activation_key: fam.activation,
        "torch_dtype": "float32",
    }
    cfg.update(fam.config_extras)
    return cfg
