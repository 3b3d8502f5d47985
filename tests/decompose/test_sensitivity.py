"""Each matrix's sensitivity α against the formula it stands for: a small random error ΔY in one
linear's outputs changes the next-token distributions by KL ≈ ½ α ‖ΔY‖² (second-order expansion
of the KL at the dense model), measured here by perturbing the outputs and computing the exact
KL over the vocabulary."""

from __future__ import annotations

import pytest
import torch

from deinfer_megatron.decompose.sensitivity import output_fisher
from tests.helpers.tiny_models import random_hf_model

NAMES = ["model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.q_proj", "model.layers.3.mlp.down_proj"]


def _kl_after_noise(model, ids: torch.Tensor, name: str, scale: float, draws: int) -> float:
    """Mean over ``draws`` of Σ_tokens KL(p ‖ p with scale·Z added to ``name``'s outputs)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        reference = torch.log_softmax(model(ids).logits.double(), -1)
        module = model.get_submodule(name)
        total = 0.0
        for _ in range(draws):
            handle = module.register_forward_hook(
                lambda _m, _a, out: out + scale * torch.randn(out.shape, generator=gen, dtype=out.dtype))
            try:
                perturbed = torch.log_softmax(model(ids).logits.double(), -1)
            finally:
                handle.remove()
            total += (reference.exp() * (reference - perturbed)).sum().item()
    return total / draws


def test_fisher_predicts_the_kl_of_an_output_error() -> None:
    model = random_hf_model("llama").double()
    ids = torch.randint(0, model.config.vocab_size, (16, 32), generator=torch.Generator().manual_seed(0))
    alpha = output_fisher(model, ids, NAMES, batch=4)
    assert all(p.requires_grad for p in model.parameters()), "the parameters are unfrozen again"
    for name in NAMES:
        out_features = model.get_submodule(name).out_features
        scale = 1e-3
        predicted = 0.5 * alpha[name] * scale**2 * ids.numel() * out_features  # ½ α E‖ΔY‖²
        measured = _kl_after_noise(model, ids, name, scale, draws=4)
        assert measured == pytest.approx(predicted, rel=0.2), name
    # the three differ by more than the tolerance, so the check tells them apart
    assert max(alpha.values()) > 1.5 * min(alpha.values())
