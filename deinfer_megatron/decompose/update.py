"""SVD-LLM's parameter update in closed form: after the truncation, U is refit with V fixed,
then V with U fixed, each the exact least-squares fit of the dense model's output on the
calibration data (``decompose --update sequential``).

For one matrix W (out × in) and its factors U (out × r), V (r × in), the update lowers

    E(U, V) = ‖X_d Wᵀ − X_s Vᵀ Uᵀ‖²_F

where X_s (tokens × in) is what the matrix reads in the partly decomposed model — the
calibration data after the decomposed layers before it and this layer's earlier decomposed
matrices — and X_d what the dense model reads at the same tokens. The target is the *dense*
model's output, so the update also takes up the error that arrives from upstream. (SVD-LLM's
published code refits U only, against W·X_s: the dense matrix on the decomposed model's input.
With sequential whitening, svd-llm's truncation already minimises ‖(W − UV)·X_sᵀ‖ over rank r
exactly, so that target would change nothing; the tests check it.)

With ``damp`` > 0 (the default), the update also pulls the product towards the dense
matrix,

    E_λ(U, V) = E(U, V) + λ‖W − U·V‖²_F,    λ = damp · mean(diag(G)),

which is the same least-squares problem on activations with √λ·I appended as extra rows to X_s
and to X_d. Without it the update fits the calibration data and little else: V is divided by
the small singular values of S in the directions the calibration barely excites, and text that
does excite them can fare worse than before the update. λ keeps those directions at W's own values; 0.01 of the mean diagonal is also
GPTQ's damping of the same Gram matrix.

E_λ depends on the data only through ``G_λ = X_sᵀX_s + λI`` and ``C_λ = X_dᵀX_s + λI`` (in × in
each, accumulated while the calibration streams through). With S Sᵀ = G_λ and the whitened
target ``T = W·C_λ·S⁻ᵀ``,

    E_λ(U, V) = ‖X_d Wᵀ‖² + λ‖W‖² − ‖T‖² + ‖T − U·Ṽ‖²_F,    Ṽ = V·S,

so each step is an ordinary least-squares problem on small whitened matrices:

    U ← argmin ‖T − U·Ṽ‖ = T Ṽᵀ (Ṽ Ṽᵀ)⁻¹        (= lstsq(X̃_s Vᵀ, X̃_d Wᵀ) on the activations)
    Ṽ ← argmin ‖T − U·Ṽ‖ = (UᵀU)⁻¹ Uᵀ T,   V = Ṽ·S⁻¹

Each step minimises E_λ over one factor with the other fixed, so E_λ never increases. S is
the Cholesky factor of G_λ (svd-llm's own whitening when λ = 0). Last, the singular values of
U·Ṽ are split evenly between the factors again (a rotation of the rank-r space; the product is
unchanged), as the truncation split them, so that healing starts from factors of like scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deinfer_megatron.decompose.factorize import Scaling, whitening

UPDATES = ("none", "sequential")
UPDATE_DAMP = 0.01  # λ as a fraction of the mean diagonal of X_sᵀX_s


@dataclass(frozen=True)
class Regression:
    """What the update needs to know of one input: the whitening S of its damped Gram matrix
    (S Sᵀ = X_sᵀX_s + λI) and the damped cross term ``C_λ = X_dᵀX_s + λI`` (None when the
    matrix reads the dense model's own input, X_s = X_d, so C_λ = G_λ)."""

    white: Scaling
    cross: torch.Tensor | None = None

    @classmethod
    def of(cls, gram: torch.Tensor, cross: torch.Tensor | None, damp: float = UPDATE_DAMP) -> Regression:
        """The update's statistics from ``G = X_sᵀX_s`` and ``C = X_dᵀX_s``, damped by
        ``λ = damp · mean(diag(G))``."""
        gram = gram.double()
        lam = damp * gram.diagonal().mean().item()
        eye = torch.eye(gram.shape[0], dtype=gram.dtype)
        return cls(whitening(gram + lam * eye), None if cross is None else cross.double() + lam * eye)

    def target(self, weight: torch.Tensor) -> torch.Tensor:
        """The whitened target ``T = W·C·S⁻ᵀ`` (out × in; W·S when C = G)."""
        w = weight.double()
        if self.cross is None:
            return self.white.apply(w)
        return self.white.undo_transposed(w @ self.cross.double())

    def refit_u(self, target: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The U (out × r) minimising E for this V."""
        vt = self.white.apply(v.double())  # Ṽ = V·S, r × in
        return torch.linalg.lstsq(vt.T, target.T).solution.T

    def refit_v(self, target: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The V (r × in) minimising E for this U."""
        return self.white.undo(torch.linalg.lstsq(u.double(), target).solution)

    def sequential(self, weight: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """U refit with V fixed, then V with the new U fixed; returned balanced, in float64."""
        target = self.target(weight)
        u = self.refit_u(target, v)
        v = self.refit_v(target, u)
        return balanced(u, v, self.white)


def balanced(u: torch.Tensor, v: torch.Tensor, white: Scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """The same product U·V with the singular values of U·(V·S) split evenly (√Σ on each side)."""
    qu, ru = torch.linalg.qr(u.double())
    qv, rv = torch.linalg.qr(white.apply(v.double()).T)
    a, sigma, bt = torch.linalg.svd(ru @ rv.T)
    root = sigma.sqrt()
    return (qu @ a) * root, white.undo(root[:, None] * (bt @ qv.T))
