"""The model families the project serves: one record each, in ``FAMILIES``.

A ``ModelFamily`` holds everything that differs between LLaMA, Qwen2 and OPT: the Hugging Face
``model_type`` names read as the family, the config.json keys its sizes come from, the norm,
activation, positions and biases of its network, the Hugging Face module names of its
projections, and the config.json values it refuses (``ConfigRule``). ``ModelArch`` keeps the
family's key; the rest of the package asks the record, never compares family names. A new
family is one record here, plus its entries in ``checkpoints/hf_names.py`` when its tensor names
differ from an existing family's (docs/ARCHITECTURE.md, "Adding a model family").

Refusals that hold for every family (sliding windows, RoPE scaling, q/k norms) are in
``refusals``; both kinds are raised when a config.json is read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "relu": F.relu}


@dataclass(frozen=True)
class ConfigRule:
    """A config.json key whose values other than the served ones the family cannot run.

    An absent or null key passes: Hugging Face then takes its default, which is served.
    """

    key: str
    served: Callable[[Any, Mapping[str, Any]], bool]  # (value, the whole config) → runs as is
    needs: str  # why another value is refused and what to do, for the one-line error

    def message(self, value: Any) -> str:
        return f"{self.key}={value!r} is not supported: {self.needs}"


def only(key: str, value: Any, needs: str) -> ConfigRule:
    """The rule that ``key`` must be ``value`` (or absent)."""
    return ConfigRule(key, lambda v, _cfg: v == value, needs)


@dataclass(frozen=True)
class ModelFamily:
    """What one family's checkpoints look like and what its network computes.

    Module names are relative to ``<layer_prefix>.<i>.``; the MLP lists the projections that
    read the layer's input first and its output projection last.
    """

    name: str  # the registry key, kept in ``ModelArch.family``
    title: str  # for messages: "LLaMA"
    model_types: tuple[str, ...]  # Hugging Face ``model_type`` values read as this family
    hf_class: str  # the transformers class of its checkpoints
    # config.json keys (None: the family has no such key and the default always holds)
    ffn_key: str  # MLP intermediate size
    kv_heads_key: str | None  # KV heads (GQA); None: as many as query heads
    head_dim_key: str | None  # None: hidden_size / heads
    norm_eps_key: str | None
    norm_eps_default: float
    max_positions_default: int | None  # None: max_position_embeddings is required
    tied_default: bool  # tie_word_embeddings when the key is absent
    activation_key: str  # where config.json names the activation
    # the network
    norm: str  # Megatron's normalization: "RMSNorm" | "LayerNorm"
    activation: str  # a key of ACTIVATIONS, as config.json spells it
    gated: bool  # SiLU-gated gate/up/down MLP; otherwise fc1 → activation → fc2
    rotary: bool  # RoPE; otherwise learned absolute positions
    position_offset: int  # rows before position 0 in the Hugging Face position table (OPT: 2)
    qkv_bias: bool  # q/k/v projections have biases
    linear_bias: bool  # every linear (o and the MLP as well) has biases
    # Hugging Face names
    decoder_prefix: str  # the module holding embeddings, layers and final norm
    attention_names: tuple[tuple[str, str], ...]  # role (q, k, v, o) → module
    mlp_names: tuple[tuple[str, str], ...]  # role (gate, up, down | fc1, fc2) → module
    hf_names: str  # this family's entry in the tables of checkpoints/hf_names.py
    rules: tuple[ConfigRule, ...] = ()  # config.json values this family refuses
    config_extras: tuple[tuple[str, Any], ...] = ()  # keys megatron_args.hf_config also writes

    @property
    def layer_prefix(self) -> str:
        return f"{self.decoder_prefix}.layers"

    @property
    def norm_bias(self) -> bool:
        """Megatron's norm has a bias next to its weight (LayerNorm; RMSNorm has none)."""
        return self.norm == "LayerNorm"

    @property
    def activation_func(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return ACTIVATIONS[self.activation]


_LLAMA_ATTENTION = tuple((r, f"self_attn.{r}_proj") for r in "qkvo")
_SILU = "only SiLU-gated MLPs (hidden_act 'silu') are implemented; use a checkpoint with hidden_act 'silu'"

LLAMA = ModelFamily(
    name="llama", title="LLaMA", model_types=("llama",), hf_class="LlamaForCausalLM",
    ffn_key="intermediate_size", kv_heads_key="num_key_value_heads", head_dim_key="head_dim",
    norm_eps_key="rms_norm_eps", norm_eps_default=1e-6, max_positions_default=2048, tied_default=False,
    activation_key="hidden_act", norm="RMSNorm", activation="silu", gated=True, rotary=True, position_offset=0,
    qkv_bias=False, linear_bias=False, decoder_prefix="model", attention_names=_LLAMA_ATTENTION,
    mlp_names=(("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj")), hf_names="llama",
    rules=(
        only("hidden_act", "silu", _SILU),
        only("attention_bias", False, "LLaMA with attention biases is not implemented (Qwen2's QKV biases "
             "are); use a checkpoint with attention_bias false"),
        only("mlp_bias", False, "LLaMA with MLP biases is not implemented; use a checkpoint with mlp_bias false"),
    ),
    config_extras=(("attention_bias", False), ("mlp_bias", False)),
)

QWEN2 = replace(  # LLaMA with QKV biases
    LLAMA, name="qwen2", title="Qwen2", model_types=("qwen2",), hf_class="Qwen2ForCausalLM", qkv_bias=True,
    rules=(only("hidden_act", "silu", _SILU),), config_extras=(("use_sliding_window", False),),
)

OPT = ModelFamily(
    name="opt", title="OPT", model_types=("opt",), hf_class="OPTForCausalLM",
    ffn_key="ffn_dim", kv_heads_key=None, head_dim_key=None, norm_eps_key=None, norm_eps_default=1e-5,
    max_positions_default=None, tied_default=True, activation_key="activation_function",
    norm="LayerNorm", activation="relu", gated=False, rotary=False, position_offset=2,
    qkv_bias=True, linear_bias=True, decoder_prefix="model.decoder",
    attention_names=(("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                     ("o", "self_attn.out_proj")),
    mlp_names=(("fc1", "fc1"), ("fc2", "fc2")), hf_names="opt",
    rules=(
        ConfigRule("word_embed_proj_dim", lambda v, cfg: v == cfg.get("hidden_size"),
                   "OPT whose embedding width differs from hidden_size (project_in/project_out) is not "
                   "implemented; use an OPT checkpoint whose word_embed_proj_dim equals its hidden_size"),
        only("do_layer_norm_before", True, "post-layer-norm OPT is not implemented, only pre-layer-norm; "
             "use a checkpoint with do_layer_norm_before true (every OPT size but 350m)"),
        only("activation_function", "relu", "only ReLU OPT models are implemented; use a checkpoint with "
             "activation_function 'relu'"),
        only("enable_bias", True, "OPT without linear biases is not implemented; use a checkpoint with "
             "enable_bias true"),
        only("layer_norm_elementwise_affine", True, "OPT layer norms without weight and bias are not "
             "implemented; use a checkpoint with layer_norm_elementwise_affine true"),
        only("_remove_final_layer_norm", False, "OPT without a final layer norm is not implemented; use a "
             "checkpoint with _remove_final_layer_norm false"),
    ),
)

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (LLAMA, QWEN2, OPT)}


def family_for_model_type(model_type: Any) -> ModelFamily:
    """The family that reads a Hugging Face ``model_type``; any other is a one-line error."""
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    supported = ", ".join(f"{t} ({f.hf_class})" for f in FAMILIES.values() for t in f.model_types)
    raise ValueError(f"unsupported architecture model_type={model_type!r}; supported: {supported}")
