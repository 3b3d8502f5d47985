"""LLaMA-shaped models with random weights, so that sizes that matter can be run and timed
without a download (``--synthetic NAME``), plus random low-rank factors for them.

The ``*-shape`` models have the layer shapes of LLaMA-1B/7B-class models but only a few layers
and a 4096-token vocabulary: the benchmark compares the cost of a layer in each layout, and with
a 32000-token vocabulary the output layer — the same in every layout — would be a third of the
bytes each rank reads per step in a 4-layer model, hiding the differences being measured.

Weights are drawn with a fixed seed and scaled so activations stay O(1) through the layers; the
same seed gives the same model on every rank.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from deinfer_megatron.arch.model import ModelArch, arch_from_hf_config

_LLAMA = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)

SYNTHETIC: dict[str, dict[str, Any]] = {
    "llama-tiny": {**_LLAMA, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 4,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256},
    "llama-1b-shape": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 4,
                       "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                       "vocab_size": 4096},
    "llama-7b-shape": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 2,
                       "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
                       "vocab_size": 4096},
}


def synthetic_config(name: str) -> dict[str, Any]:
    """The Hugging Face config dict of a synthetic model."""
    if name not in SYNTHETIC:
        raise ValueError(f"unknown synthetic model {name!r}; choose one of {', '.join(SYNTHETIC)}")
    return dict(SYNTHETIC[name])


def synthetic_arch(name: str) -> ModelArch:
    return arch_from_hf_config(synthetic_config(name))


def random_state(arch: ModelArch, ranks: Mapping[str, int], seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A Hugging Face-named state dict: dense ``.weight`` for plain matrices, random ``.u``/``.v``
    for the matrices in ``ranks`` (their product has the scale of a dense init)."""
    if arch.family != "llama":
        raise ValueError("synthetic models are LLaMA-shaped")
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    h = arch.hidden_size
    state = {
        "model.embed_tokens.weight": randn(arch.vocab_size, h, std=1.0),
        "model.norm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": randn(arch.vocab_size, h, std=h**-0.5),
    }
    for layer in range(arch.num_layers):
        state[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        state[f"model.layers.{layer}.post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    for name, (m, n) in arch.linear_shapes().items():
        if name in ranks:
            r = ranks[name]
            state[f"{name}.u"] = randn(m, r, std=r**-0.5)
            state[f"{name}.v"] = randn(r, n, std=n**-0.5)
        else:
            state[f"{name}.weight"] = randn(m, n, std=n**-0.5)
    return state
