"""LLaMA-shaped models with random weights, so that sizes that matter can be run and timed
without a download (``--synthetic NAME``), plus random weights and low-rank factors for the
architecture of any family (``random_state``).

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
from deinfer_megatron.checkpoints.hf_names import (OUTPUT_LAYER, POSITION_EMBEDDINGS, WORD_EMBEDDINGS, global_names,
                                                   norm_names)

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
    """A Hugging Face-named state dict of ``arch``'s family: dense ``.weight`` for plain matrices,
    random ``.u``/``.v`` for the matrices in ``ranks`` (their product has the scale of a dense
    init), norms at one, biases at zero; the names come from ``checkpoints.hf_names``."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    fam, h = arch.model_family, arch.hidden_size
    state: dict[str, torch.Tensor] = {}
    for name, ours in global_names(fam).items():
        if ours == WORD_EMBEDDINGS:
            state[name] = randn(arch.vocab_size, h, std=1.0)
        elif ours == POSITION_EMBEDDINGS:
            state[name] = randn(arch.max_positions + fam.position_offset, h, std=1.0)
        elif ours == OUTPUT_LAYER:
            state[name] = randn(arch.vocab_size, h, std=h**-0.5)
        else:  # the final norm
            state[name] = (torch.zeros if name.endswith(".bias") else torch.ones)(h, dtype=dtype)
    for layer in range(arch.num_layers):
        for suffix in norm_names(fam):
            fill = torch.zeros if suffix.endswith(".bias") else torch.ones
            state[f"{arch.layer_prefix}.{layer}.{suffix}"] = fill(h, dtype=dtype)
    biased = {name for layer in range(arch.num_layers)
              for role, name in {**arch.attention_modules(layer), **arch.mlp_modules(layer)}.items()
              if arch.linear_bias or (arch.qkv_bias and role in ("q", "k", "v"))}
    for name, (m, n) in arch.linear_shapes().items():
        if name in ranks:
            r = ranks[name]
            state[f"{name}.u"] = randn(m, r, std=r**-0.5)
            state[f"{name}.v"] = randn(r, n, std=n**-0.5)
        else:
            state[f"{name}.weight"] = randn(m, n, std=n**-0.5)
        if name in biased:
            state[f"{name}.bias"] = torch.zeros(m, dtype=dtype)
    return state
