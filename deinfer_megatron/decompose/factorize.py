"""Truncated factorisations ``W ≈ U·V`` of one matrix (out × in), by method.

Every method truncates the SVD of ``W·S`` for an input-channel scaling ``S`` and folds ``S⁻¹``
back into V; the methods differ only in S:

* ``svd``: S = I — minimises ‖W − UV‖_F, blind to the data.
* ``asvd``: ``S = diag(mean|x|^α)`` from the calibration activations: channels that carry
  large activations are kept more faithfully. The ASVD paper uses α = 0.5; on SmolLM2 (whose
  activations have massive outlier channels) ratio 0.8 gave perplexity 5.7·10⁶ at α = 0.5,
  1.4·10⁴ at α = 1 and 2.6·10³ at α = 2, so the default is α = 1 (``--asvd-alpha``).
* ``svd-llm``: S is the Cholesky factor of the calibration Gram matrix ``XᵀX`` (so
  ``‖(W − W') X‖_F = ‖(W − W') S‖_F``): the truncation is optimal for the output error on the
  calibration data. When ``XᵀX`` is not positive definite, jitter is added to its diagonal; if
  Cholesky still fails, a symmetric eigendecomposition with clamped eigenvalues gives the
  square root instead.

The scaling depends only on a matrix's *input*, so it is built once per group of matrices that
read the same input (q/k/v, gate/up) — for svd-llm that is one Cholesky of an in × in matrix,
the costliest step after the SVD itself. ``S⁻¹`` is never formed for a Cholesky factor: V·S⁻¹
is a triangular solve, half the work of the explicit inverse and fewer roundings. Truncation
losses need only the singular values (``spectrum``), which cost 40-60 % of a full SVD.

All maths in float64; the singular values are split evenly (``√Σ``) between U and V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ASVD_ALPHA = 1.0
METHODS = ("svd", "asvd", "svd-llm")


@dataclass(frozen=True)
class Scaling:
    """An input-channel scaling S: ``apply`` gives W·S, ``undo`` gives V·S⁻¹.

    ``s`` is None (identity), a vector (diagonal), or a matrix; ``s_inv`` is the matrix inverse
    when S is a general matrix, None when S is lower triangular (undone by a solve)."""

    s: torch.Tensor | None = None
    s_inv: torch.Tensor | None = None

    def apply(self, w: torch.Tensor) -> torch.Tensor:
        if self.s is None:
            return w
        return w * self.s if self.s.dim() == 1 else w @ self.s

    def undo(self, v: torch.Tensor) -> torch.Tensor:
        if self.s is None:
            return v
        if self.s.dim() == 1:
            return v / self.s
        if self.s_inv is not None:
            return v @ self.s_inv
        return torch.linalg.solve_triangular(self.s, v, upper=False, left=False)  # X·S = V

    def undo_transposed(self, t: torch.Tensor) -> torch.Tensor:
        """``t·S⁻ᵀ`` (for a Cholesky factor: a triangular solve against Sᵀ)."""
        if self.s is None:
            return t
        if self.s.dim() == 1:
            return t / self.s
        if self.s_inv is not None:
            return t @ self.s_inv.T
        return torch.linalg.solve_triangular(self.s.T, t, upper=True, left=False)  # X·Sᵀ = T


def whitening(gram: torch.Tensor, max_tries: int = 6) -> Scaling:
    """S with ``S Sᵀ = XᵀX``: the lower-triangular Cholesky factor when possible."""
    gram = gram.double()
    n = gram.shape[0]
    scale = gram.diagonal().mean().clamp_min(1e-12)
    eye = torch.eye(n, dtype=gram.dtype)
    for attempt in range(max_tries):
        jitter = 0.0 if attempt == 0 else scale * 10.0 ** (attempt - 8)
        chol, info = torch.linalg.cholesky_ex(gram + jitter * eye)
        if int(info) == 0:
            return Scaling(chol)
    vals, vecs = torch.linalg.eigh(gram)
    vals = vals.clamp_min(scale * 1e-6)
    return Scaling(vecs * vals.sqrt(), (vecs / vals.sqrt()).T)


def scaling(
    method: str, *, gram: torch.Tensor | None = None, abs_mean: torch.Tensor | None = None, alpha: float = ASVD_ALPHA
) -> Scaling:
    """The scaling of ``method`` for one input (shared by every matrix that reads it)."""
    if method == "svd":
        return Scaling()
    if method == "asvd":
        if abs_mean is None:
            raise ValueError("asvd needs calibration activations (mean |x| per input channel)")
        return Scaling(abs_mean.double().clamp_min(1e-6) ** alpha)
    if method == "svd-llm":
        if gram is None:
            raise ValueError("svd-llm needs the calibration Gram matrix XᵀX")
        return whitening(gram)
    raise ValueError(f"unknown method {method!r}; choose {', '.join(METHODS)}")


@dataclass
class Prepared:
    """A matrix ready to truncate: ``W·S = P Σ Qᵀ`` and the scaling to undo in V."""

    p: torch.Tensor  # out × n
    sigma: torch.Tensor  # n, descending
    qt: torch.Tensor  # n × in  (rows of Qᵀ)
    scale: Scaling

    def factors(self, rank: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(U, V)`` of shapes ``(out, rank)`` and ``(rank, in)``."""
        root = self.sigma[:rank].sqrt()
        u = self.p[:, :rank] * root
        v = self.scale.undo(root[:, None] * self.qt[:rank])
        return u.to(dtype).contiguous(), v.to(dtype).contiguous()

    def truncation_loss(self) -> torch.Tensor:
        return truncation_loss(self.sigma)


def prepare(weight: torch.Tensor, scale: Scaling) -> Prepared:
    """SVD of the scaled matrix ``W·S``."""
    p, sigma, qt = torch.linalg.svd(scale.apply(weight.double()), full_matrices=False)
    return Prepared(p, sigma, qt, scale)


def spectrum(weight: torch.Tensor, scale: Scaling) -> torch.Tensor:
    """The singular values of ``W·S`` alone (descending), for truncation losses."""
    return torch.linalg.svdvals(scale.apply(weight.double()))


def truncation_loss(sigma: torch.Tensor) -> torch.Tensor:
    """``loss[k]`` = squared (scaled) error of keeping rank k, for k = 0..n."""
    tail = (sigma**2).flip(0).cumsum(0).flip(0)
    return torch.cat([tail, tail.new_zeros(1)])
