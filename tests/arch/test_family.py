"""The family registry and the config.json refusals, on configs made by transformers itself.

Every config is a real ``transformers`` config object written to ``config.json`` as its
``to_dict()`` (``_folder``) and read back with ``load_arch``, as every command reads a model
folder. Where the Hub's files differ from what transformers 5 writes (``rope_scaling`` instead
of ``rope_parameters``, Qwen2's ``sliding_window`` kept while ``use_sliding_window`` is false,
no ``layer_types``), the dict is edited to the Hub's form and the edit says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch.nn.functional as F
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from deinfer_megatron.arch.family import FAMILIES, ModelFamily, family_for_model_type
from deinfer_megatron.arch.model import ModelArch, arch_from_hf_config, load_arch, transformer_config
from deinfer_megatron.arch.refusals import QK_NORM_KEYS
from tests.helpers.tiny_models import TINY_CONFIGS

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=101, max_position_embeddings=128)
LLAMA_31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64}


def _folder(tmp_path: Path, cfg: transformers.PretrainedConfig | dict[str, Any]) -> Path:
    raw = cfg if isinstance(cfg, dict) else cfg.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def _hub_form(cfg: transformers.PretrainedConfig, **edits: Any) -> dict[str, Any]:
    """``cfg`` as a config.json on the Hub spells it: ``edits`` set (None deletes a key)."""
    raw = cfg.to_dict()
    for key, value in edits.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def _mistral_as_llama(**kw: Any) -> dict[str, Any]:
    """A Mistral checkpoint relabelled LLaMA (its weights have LLaMA's names and shapes)."""
    return {**transformers.MistralConfig(**{**SMALL, **kw}).to_dict(), "model_type": "llama"}


def _qwen2_hub_window() -> dict[str, Any]:
    """Qwen2 with its window switched on, as transformers 4 wrote it: no ``layer_types``, layers
    from ``max_window_layers`` on slide."""
    cfg = transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    return _hub_form(cfg, layer_types=None)


# (id, the config, the key the refusal names)
REFUSED: list[tuple[str, Callable[[], Any], str]] = [
    ("mistral-window", lambda: _mistral_as_llama(sliding_window=64), "sliding_window"),
    ("qwen2-window", lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64,
                                                      max_window_layers=2), "sliding_window"),
    ("qwen2-window-hub", _qwen2_hub_window, "sliding_window"),
    ("llama31-scaling", lambda: transformers.LlamaConfig(**SMALL, rope_scaling=LLAMA_31_SCALING), "rope_parameters"),
    ("llama31-scaling-hub", lambda: _hub_form(transformers.LlamaConfig(**SMALL), rope_parameters=None,
                                              rope_theta=500000.0, rope_scaling=LLAMA_31_SCALING), "rope_scaling"),
    ("qwen2-yarn", lambda: transformers.Qwen2Config(**SMALL, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}), "rope_parameters"),
    ("linear-scaling-old-key", lambda: _hub_form(transformers.LlamaConfig(**SMALL), rope_parameters=None,
                                                 rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    ("per-layer-rope", lambda: _hub_form(transformers.Qwen2Config(**SMALL), rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}), "rope_parameters"),
    ("partial-rope", lambda: transformers.LlamaConfig(**SMALL, partial_rotary_factor=0.5), "partial_rotary_factor"),
    *[(f"qk-norm-{key}", lambda key=key: transformers.LlamaConfig(**SMALL, **{key: True}), key)
      for key in QK_NORM_KEYS],
    ("llama-attention-bias", lambda: transformers.LlamaConfig(**SMALL, attention_bias=True), "attention_bias"),
    ("llama-mlp-bias", lambda: transformers.LlamaConfig(**SMALL, mlp_bias=True), "mlp_bias"),
    ("llama-gelu", lambda: transformers.LlamaConfig(**SMALL, hidden_act="gelu"), "hidden_act"),
    ("qwen2-gelu", lambda: transformers.Qwen2Config(**SMALL, hidden_act="gelu"), "hidden_act"),
    ("opt-350m", lambda: transformers.OPTConfig(hidden_size=64, ffn_dim=96, num_attention_heads=4,
                                                word_embed_proj_dim=32), "word_embed_proj_dim"),
    ("opt-post-norm", lambda: transformers.OPTConfig(do_layer_norm_before=False), "do_layer_norm_before"),
    ("opt-gelu", lambda: transformers.OPTConfig(activation_function="gelu"), "activation_function"),
    ("opt-no-bias", lambda: transformers.OPTConfig(enable_bias=False), "enable_bias"),
    ("opt-plain-norm", lambda: transformers.OPTConfig(layer_norm_elementwise_affine=False),
     "layer_norm_elementwise_affine"),
    ("opt-no-final-norm", lambda: transformers.OPTConfig(_remove_final_layer_norm=True), "_remove_final_layer_norm"),
]


@pytest.mark.parametrize("make, key", [pytest.param(m, k, id=i) for i, m, k in REFUSED])
def test_each_refusal_is_one_line_naming_the_key_its_value_and_the_file(tmp_path, make, key) -> None:
    cfg = make()
    raw = cfg if isinstance(cfg, dict) else cfg.to_dict()
    folder = _folder(tmp_path, raw)
    with pytest.raises(ValueError) as err:
        load_arch(folder)
    message = str(err.value)
    assert "\n" not in message
    value = raw[key] if raw.get(key) is not None else raw["rope_parameters"][key]  # transformers 5 moves
    assert message.startswith(f"{folder / 'config.json'}: {key}={value!r} is not supported: ")  # partial_rotary_factor
    assert "; use " in message or "; set " in message, "the line says what to do"
    with pytest.raises(ValueError, match=f"^config.json: {key}="):  # the same line without a folder
        arch_from_hf_config(raw)


@pytest.mark.parametrize("config", [
    pytest.param(lambda: transformers.MistralConfig(**SMALL, sliding_window=64), id="mistral"),
    pytest.param(lambda: transformers.Qwen3Config(**SMALL), id="qwen3-qk-norms"),
    pytest.param(lambda: transformers.GPT2Config(), id="gpt2"),
])
def test_an_unknown_model_type_lists_the_supported_ones(tmp_path, config) -> None:
    cfg = config()
    folder = _folder(tmp_path, cfg)
    with pytest.raises(ValueError) as err:
        load_arch(folder)
    assert str(err.value) == (
        f"{folder / 'config.json'}: unsupported architecture model_type={cfg.model_type!r}; supported: "
        "llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM), opt (OPTForCausalLM)"
    )


@pytest.mark.parametrize("raw", [
    # Qwen2.5's config.json: a window on record, switched off
    pytest.param(lambda: _hub_form(transformers.Qwen2Config(**SMALL), sliding_window=64, use_sliding_window=False),
                 id="qwen2-window-off"),
    # switched on, but no layer slides: max_window_layers covers them all
    pytest.param(lambda: _hub_form(transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64,
                                                            max_window_layers=4), layer_types=None),
                 id="qwen2-no-layer-slides"),
    pytest.param(lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64,
                                                  max_window_layers=4).to_dict(), id="qwen2-full-layer-types"),
    # a window as long as the context is full attention
    pytest.param(lambda: _mistral_as_llama(sliding_window=128), id="window-covers-context"),
    pytest.param(lambda: _mistral_as_llama(sliding_window=None), id="mistral-v0.2-no-window"),
    # LLaMA-2's config.json: rope_scaling null next to rope_theta
    pytest.param(lambda: _hub_form(transformers.LlamaConfig(**SMALL), rope_parameters=None)
                 | {"rope_scaling": None, "rope_theta": 500000.0}, id="rope-scaling-null"),
    pytest.param(lambda: transformers.LlamaConfig(**SMALL, partial_rotary_factor=1.0).to_dict(), id="whole-head-rope"),
    pytest.param(lambda: transformers.LlamaConfig(**SMALL, use_qk_norm=False).to_dict(), id="qk-norm-off"),
])
def test_settings_equal_to_what_is_implemented_still_load(tmp_path, raw) -> None:
    cfg = raw()
    arch = load_arch(_folder(tmp_path, cfg))
    assert arch.family == family_for_model_type(cfg["model_type"]).name
    assert (arch.num_layers, arch.hidden_size, arch.max_positions) == (4, 64, 128)


def test_rope_theta_is_read_where_each_transformers_version_writes_it(tmp_path) -> None:
    v5 = transformers.LlamaConfig(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 250000.0})
    assert arch_from_hf_config(v5.to_dict()).rope_theta == 250000.0
    v4 = _hub_form(v5, rope_parameters=None) | {"rope_theta": 500000.0, "rope_scaling": None}
    assert arch_from_hf_config(v4).rope_theta == 500000.0
    assert arch_from_hf_config(_hub_form(v5, rope_parameters=None)).rope_theta == 10000.0  # transformers' default


def test_model_types_are_read_by_exactly_one_family() -> None:
    assert all(name == fam.name for name, fam in FAMILIES.items())
    types = [t for fam in FAMILIES.values() for t in fam.model_types]
    assert len(types) == len(set(types))
    for fam in FAMILIES.values():
        for model_type in fam.model_types:
            assert family_for_model_type(model_type) is fam
            assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == fam.hf_class


def _hf_module_kinds(family: str) -> tuple[str, str]:
    """(norm class name, activation class name) of the first layer of transformers' model."""
    from tests.helpers.tiny_models import random_hf_model

    model = random_hf_model(family)
    fam = FAMILIES[family]
    layer = model.get_submodule(f"{fam.layer_prefix}.0")
    norm = next(type(m).__name__ for n, m in layer.named_modules() if "norm" in type(m).__name__.lower())
    act = next(type(m).__name__ for n, m in layer.named_modules() if n.endswith(("act_fn", "activation_fn")))
    return norm, act


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_each_record_describes_the_transformers_model_and_megatrons_config(family: str) -> None:
    fam: ModelFamily = FAMILIES[family]
    arch = arch_from_hf_config(TINY_CONFIGS[family])
    assert arch.model_family is fam
    norm, act = _hf_module_kinds(family)
    assert norm.endswith("RMSNorm") == (fam.norm == "RMSNorm") and act.lower().startswith(fam.activation)
    cfg = transformer_config(arch, tp=1, pp=1)
    assert cfg.normalization == fam.norm and cfg.gated_linear_unit == fam.gated
    assert cfg.activation_func is {"silu": F.silu, "relu": F.relu}[fam.activation]
    assert (cfg.add_qkv_bias, cfg.add_bias_linear) == (fam.qkv_bias, fam.linear_bias)
    assert arch.rope_theta > 0 if fam.rotary else arch.rope_theta == 0.0
    mlp = list(arch.mlp_modules(0))
    assert mlp == (["gate", "up", "down"] if fam.gated else ["fc1", "fc2"])


def test_a_model_arch_names_a_registered_family() -> None:
    arch = arch_from_hf_config(TINY_CONFIGS["llama"])
    with pytest.raises(ValueError, match="unknown model family 'mistral'; known: llama, qwen2, opt"):
        ModelArch(**{**arch.__dict__, "family": "mistral"})
