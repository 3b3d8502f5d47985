"""The factorisations and the uniform rank, against their defining formulas (the allocation:
test_allocation.py)."""

from __future__ import annotations

import pytest
import torch

from deinfer_megatron.decompose.allocation import uniform_rank
from deinfer_megatron.decompose.factorize import prepare, scaling, spectrum, whitening

gen = torch.Generator().manual_seed(0)


def correlated_inputs(n: int, d: int) -> torch.Tensor:
    """Activations with a few dominant, correlated channels (like real LLM inputs)."""
    mix = torch.randn(d, d, generator=gen, dtype=torch.float64)
    scales = torch.logspace(1, -2, d, dtype=torch.float64)
    return (torch.randn(n, d, generator=gen, dtype=torch.float64) * scales) @ mix


@pytest.mark.parametrize("method", ["svd", "asvd", "svd-llm"])
def test_full_rank_reproduces_the_matrix(method: str) -> None:
    w = torch.randn(24, 16, generator=gen, dtype=torch.float64)
    x = correlated_inputs(200, 16)
    u, v = prepare(w, scaling(method, gram=x.T @ x, abs_mean=x.abs().mean(0))).factors(16, dtype=torch.float64)
    torch.testing.assert_close(u @ v, w)


def test_svd_llm_minimises_the_output_error_and_predicts_it() -> None:
    w = torch.randn(32, 24, generator=gen, dtype=torch.float64)
    x = correlated_inputs(500, 24)
    gram = x.T @ x
    errors = {}
    for method in ("svd", "asvd", "svd-llm"):
        prepared = prepare(w, scaling(method, gram=gram, abs_mean=x.abs().mean(0)))
        u, v = prepared.factors(8, dtype=torch.float64)
        errors[method] = ((x @ (w - u @ v).T) ** 2).sum().item()
        if method == "svd-llm":
            # the whitened truncation loss is exactly the output error on the calibration data
            assert prepared.truncation_loss()[8].item() == pytest.approx(errors[method], rel=1e-8)
        # the singular values alone (the variadic allocation's losses) are the full SVD's
        torch.testing.assert_close(spectrum(w, prepared.scale), prepared.sigma, rtol=1e-12, atol=0)
    assert errors["svd-llm"] < errors["asvd"] < errors["svd"]


def test_whitening_survives_a_singular_gram_matrix() -> None:
    x = correlated_inputs(6, 16)  # 6 samples of 16 channels: XᵀX has rank 6
    white = whitening(x.T @ x)
    s = white.apply(torch.eye(16, dtype=torch.float64))
    assert torch.isfinite(s).all() and torch.isfinite(white.undo(s)).all()
    torch.testing.assert_close(white.undo(s), torch.eye(16, dtype=torch.float64), atol=1e-6, rtol=0)
    w = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    u, v = prepare(w, scaling("svd-llm", gram=x.T @ x)).factors(4, dtype=torch.float64)
    assert torch.isfinite(u @ v).all()


@pytest.mark.parametrize("tries", [6, 0], ids=["cholesky", "eigh"])
def test_whitening_squares_to_the_gram_matrix_and_undoes_itself(tries: int) -> None:
    x = torch.randn(300, 20, generator=gen, dtype=torch.float64)  # well conditioned: nothing clamped
    gram = x.T @ x
    white = whitening(gram, max_tries=tries)  # no tries: the eigendecomposition fallback
    assert (white.s_inv is None) == (tries > 0), "a Cholesky factor is undone by a triangular solve"
    s = white.apply(torch.eye(20, dtype=torch.float64))
    torch.testing.assert_close(s @ s.T, gram, rtol=1e-10, atol=1e-8 * gram.abs().max().item())
    v = torch.randn(7, 20, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(white.undo(v), v @ torch.linalg.inv(s), rtol=1e-8, atol=1e-10)


def test_uniform_rank_formula() -> None:
    assert uniform_rank(576, 576, 0.8) == round(0.8 * 576 * 576 / 1152)
    assert uniform_rank(1536, 576, 1.0) == round(1536 * 576 / 2112)
    assert uniform_rank(4, 4, 0.01) == 1
    with pytest.raises(ValueError, match=r"--ratio must be in \(0, 1\]"):
        uniform_rank(4, 4, 1.5)
