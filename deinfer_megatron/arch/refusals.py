"""The config.json settings the project cannot serve, refused when the config is read.

A key the project does not implement must not load and be ignored: the model would run, give
other logits than the checkpoint's own network, and nothing would say why. ``refuse_unsupported``
raises one ``ValueError`` line naming the key, its value and what to do for

- a value its family refuses (``ModelFamily.rules``: OPT's post-layer-norm, LLaMA's biases, ...);
- a sliding window shorter than the context (Mistral's ``sliding_window``; Qwen2's when
  ``use_sliding_window`` is true and some layer slides). A window as long as the context is full
  causal attention, and so is Qwen2's usual ``sliding_window`` with ``use_sliding_window`` false;
- RoPE other than plain RoPE over the whole head with ``rope_theta``: ``rope_scaling`` (the key
  transformers 4 writes) or ``rope_parameters`` (transformers 5) of a ``rope_type`` other than
  ``default``, per-layer-type RoPE parameters, a ``partial_rotary_factor`` below 1;
- normalised queries and keys (``qk_norm``, ``use_qk_norm``, ``qk_layernorm``).

``arch.model`` calls it before any ``ModelArch`` exists, so every command refuses before a rank
starts.
"""

from __future__ import annotations

from typing import Any, Mapping

from deinfer_megatron.arch.family import ModelFamily

QK_NORM_KEYS = ("qk_norm", "use_qk_norm", "qk_layernorm")
DEFAULT_THETA = 10000.0


def refuse_unsupported(family: ModelFamily, cfg: Mapping[str, Any], max_positions: int) -> None:
    """Raise ``ValueError`` for the first setting of ``cfg`` the project cannot serve."""
    for rule in family.rules:
        value = cfg.get(rule.key)
        if value is not None and not rule.served(value, cfg):
            raise ValueError(rule.message(value))
    for key in QK_NORM_KEYS:
        if cfg.get(key):
            raise ValueError(f"{key}={cfg[key]!r} is not supported: normalised queries and keys (q/k norms) are "
                             "not implemented; use a checkpoint without them")
    _refuse_sliding_window(cfg, max_positions)
    if family.rotary:
        _refuse_rope_variants(cfg)


def _refuse_sliding_window(cfg: Mapping[str, Any], max_positions: int) -> None:
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", True):  # Qwen2's switch; Mistral has none
        return
    layer_types = cfg.get("layer_types")
    if layer_types is not None:  # transformers 5 names each layer's attention
        if "sliding_attention" not in layer_types:
            return
    elif cfg.get("max_window_layers", 0) >= cfg.get("num_hidden_layers", 1):  # Qwen2: layers from it on slide
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r} is not supported: a window is a positive number of tokens; "
                         "set it to null in config.json if the model attends to the whole context")
    if window < max_positions:
        raise ValueError(
            f"sliding_window={window} is not supported: the window is shorter than max_position_embeddings="
            f"{max_positions} and sliding-window attention is not implemented, only full causal attention; set "
            f"max_position_embeddings to {window} or less in config.json (the window then covers every sequence) "
            "or use a checkpoint without a sliding window"
        )


def rope_parameters(cfg: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """``(key, parameters)`` of the RoPE settings, read as transformers reads them: a non-empty
    ``rope_scaling`` wins over ``rope_parameters``; neither gives ``("rope_parameters", {})``."""
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if value:
            if not isinstance(value, Mapping):
                raise ValueError(f"{key}={value!r} is not supported: it must be an object of RoPE parameters "
                                 "or null; fix config.json")
            return key, value
    return "rope_parameters", {}


def _refuse_rope_variants(cfg: Mapping[str, Any]) -> None:
    key, params = rope_parameters(cfg)
    shown = repr(dict(params))
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"{key}={shown} is not supported: RoPE parameters per layer type are not implemented, "
                         "only one plain RoPE for every layer; use a checkpoint with a single rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise ValueError(f"{key}={shown} is not supported: RoPE scaling {kind!r} is not implemented, only plain "
                         f"RoPE with rope_theta (rope_type 'default'); use a checkpoint without RoPE scaling")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported: RoPE over part of each head is not "
                         "implemented, only over the whole head; use a checkpoint with partial_rotary_factor 1")


def rope_theta(cfg: Mapping[str, Any]) -> float:
    """RoPE's base: the RoPE parameters' ``rope_theta``, else the top-level key, else 10000."""
    _, params = rope_parameters(cfg)
    for value in (params.get("rope_theta"), cfg.get("rope_theta")):
        if value is not None:
            return float(value)
    return DEFAULT_THETA
