"""Truncated factorisations ``W ≈ U·V`` of one matrix (out × in), by method.

* ``svd``: plain truncated SVD of W — minimises ‖W − UV‖_F, blind to the data.
* ``asvd``: scale the input channels by the calibration activations' mean magnitude
  (``S = diag(mean|x|^α)``), truncate the SVD of ``W·S``, fold ``S⁻¹`` back into V: channels
  that carry large activations are kept more faithfully. The ASVD paper uses α = 0.5; on
  SmolLM2 (whose activations have massive outlier channels) ratio 0.8 gave perplexity 5.7·10⁶
  at α = 0.5, 1.4·10⁴ at α = 1 and 2.6·10³ at α = 2, so the default is α = 1 (``--asvd-alpha``).
* ``svd-llm``: whiten with the Cholesky factor ``S`` of the calibration Gram matrix ``XᵀX``
  (so ``‖(W − W') X‖_F = ‖(W − W') S‖_F``), truncate the SVD of ``W·S``, fold ``S⁻¹`` into V:
  the truncation is optimal for the output error on the calibration data. When ``XᵀX`` is not
  positive definite, jitter is added to its diagonal; if Cholesky still fails, a symmetric
  eigendecomposition with clamped eigenvalues gives the square root instead.

All maths in float64; the singular values are split evenly (``√Σ``) between U and V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ASVD_ALPHA = 1.0


@dataclass
class Prepared:
    """A matrix ready to truncate: ``W·S = P Σ Qᵀ`` and how to undo the scaling of V."""

    p: torch.Tensor  # out × n
    sigma: torch.Tensor  # n, descending
    qt: torch.Tensor  # n × in  (rows of Qᵀ)
    s_inv: torch.Tensor | None  # in × in (or a vector for a diagonal scaling); None = identity

    def factors(self, rank: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(U, V)`` of shapes ``(out, rank)`` and ``(rank, in)``."""
        root = self.sigma[:rank].sqrt()
        u = self.p[:, :rank] * root
        v = root[:, None] * self.qt[:rank]
        if self.s_inv is not None:
            v = v * self.s_inv if self.s_inv.dim() == 1 else v @ self.s_inv
        return u.to(dtype).contiguous(), v.to(dtype).contiguous()

    def truncation_loss(self) -> torch.Tensor:
        """``loss[k]`` = squared (whitened) error of keeping rank k, for k = 0..n."""
        tail = (self.sigma**2).flip(0).cumsum(0).flip(0)
        return torch.cat([tail, tail.new_zeros(1)])


def whitening(gram: torch.Tensor, max_tries: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S, S⁻¹)`` with ``S Sᵀ = XᵀX`` (lower-triangular Cholesky factor when possible)."""
    gram = gram.double()
    n = gram.shape[0]
    scale = gram.diagonal().mean().clamp_min(1e-12)
    eye = torch.eye(n, dtype=gram.dtype)
    for attempt in range(max_tries):
        jitter = 0.0 if attempt == 0 else scale * 10.0 ** (attempt - 8)
        chol, info = torch.linalg.cholesky_ex(gram + jitter * eye)
        if int(info) == 0:
            return chol, torch.linalg.solve_triangular(chol, eye, upper=False)
    vals, vecs = torch.linalg.eigh(gram)
    vals = vals.clamp_min(scale * 1e-6)
    return vecs * vals.sqrt(), (vecs / vals.sqrt()).T


def prepare(
    weight: torch.Tensor,
    method: str,
    *,
    gram: torch.Tensor | None = None,
    abs_mean: torch.Tensor | None = None,
    alpha: float = ASVD_ALPHA,
) -> Prepared:
    """SVD of the (scaled) matrix for ``method`` in {"svd", "asvd", "svd-llm"}."""
    w = weight.double()
    if method == "svd":
        p, sigma, qt = torch.linalg.svd(w, full_matrices=False)
        return Prepared(p, sigma, qt, None)
    if method == "asvd":
        if abs_mean is None:
            raise ValueError("asvd needs calibration activations (mean |x| per input channel)")
        s = abs_mean.double().clamp_min(1e-6) ** alpha
        p, sigma, qt = torch.linalg.svd(w * s, full_matrices=False)
        return Prepared(p, sigma, qt, 1.0 / s)
    if method == "svd-llm":
        if gram is None:
            raise ValueError("svd-llm needs the calibration Gram matrix XᵀX")
        s, s_inv = whitening(gram)
        p, sigma, qt = torch.linalg.svd(w @ s, full_matrices=False)
        return Prepared(p, sigma, qt, s_inv)
    raise ValueError(f"unknown method {method!r}; choose svd, asvd or svd-llm")
