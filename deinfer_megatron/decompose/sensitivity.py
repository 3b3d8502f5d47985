"""How much the whole model's output cares about an error in one matrix's output: the weights
that turn each matrix's truncation loss into one comparable, end-to-end currency
(``decompose --allocation fisher``, decompose/allocation.py).

A small change ΔY of the outputs of one linear changes the model's next-token distributions by

    KL(p_dense ‖ p) ≈ ½ ΔYᵀ F ΔY,    F = E_{y∼p}[∇_Y log p(y) ∇_Y log p(y)ᵀ]

(the first-order term vanishes at the dense model; F, the Fisher information of the outputs, is
the Hessian of that KL there). Taking F's diagonal and averaging it over the tokens and output
channels of each matrix gives one number per matrix,

    α_m = mean_{t, j} (∂ log p(y) / ∂Y_m[t, j])²,

so that ``½ α_m · ‖ΔY_m‖²`` — with ‖ΔY_m‖² the truncation loss measured on the calibration
data — predicts what truncating matrix m costs the model as a whole. The labels y are sampled
from the dense model's own next-token distributions (the true Fisher, not the empirical one of
the text's tokens), one per position; one backward pass of ``Σ log p(y)`` over the calibration
windows gives every matrix's gradients at once. Only activations are differentiated (the
parameters are frozen for the pass).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def output_fisher(model: nn.Module, ids: torch.Tensor, names: Iterable[str], *, batch: int = 2,
                  seed: int = 0) -> dict[str, float]:
    """``α_m`` of every linear in ``names`` over the ``[n, seq]`` calibration windows ``ids``."""
    modules = dict(model.named_modules())
    names = list(names)
    sums = {n: torch.zeros((), dtype=torch.float64) for n in names}
    counts = dict.fromkeys(names, 0)

    def keep(name: str):
        def forward_hook(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> None:
            def grad_hook(grad: torch.Tensor) -> None:
                sums[name] += grad.double().pow(2).sum()
                counts[name] += grad.numel()

            out.register_hook(grad_hook)

        return forward_hook

    frozen = [(p, p.requires_grad) for p in model.parameters()]
    handles = [modules[n].register_forward_hook(keep(n)) for n in names]
    gen = torch.Generator().manual_seed(seed)
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        with torch.enable_grad():
            for chunk in ids.split(batch):
                embeds = model.get_input_embeddings()(chunk).detach().requires_grad_(True)
                logits = model(inputs_embeds=embeds).logits.float()
                logp = torch.log_softmax(logits, dim=-1).reshape(-1, logits.shape[-1])
                with torch.no_grad():
                    labels = torch.multinomial(logp.exp(), 1, generator=gen)
                logp.gather(1, labels).sum().backward()
    finally:
        for h in handles:
            h.remove()
        for p, wanted in frozen:
            p.requires_grad_(wanted)
    return {n: (sums[n] / max(counts[n], 1)).item() for n in names}
