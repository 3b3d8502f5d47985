"""SVD-LLM's sequential parameter update against direct solves of the same least-squares
problems on the activations themselves (torch.linalg.lstsq), and the calibration output error
it lowers."""

from __future__ import annotations

import pytest
import torch

from deinfer_megatron.decompose.factorize import prepare, scaling, whitening
from deinfer_megatron.decompose.update import Regression, balanced

gen = torch.Generator().manual_seed(0)
TOKENS, OUT, IN, RANK = 300, 12, 10, 4


def activations() -> tuple[torch.Tensor, torch.Tensor]:
    """(X_d, X_s): the dense model's inputs, and the decomposed model's at the same tokens — the
    same correlated channels plus an error that came from upstream."""
    mix = torch.randn(IN, IN, generator=gen, dtype=torch.float64)
    dense = (torch.randn(TOKENS, IN, generator=gen, dtype=torch.float64) * torch.logspace(1, -1, IN,
                                                                                          dtype=torch.float64)) @ mix
    drifted = dense + 0.3 * torch.randn(TOKENS, IN, generator=gen, dtype=torch.float64) @ mix
    return dense, drifted


def error(w: torch.Tensor, u: torch.Tensor, v: torch.Tensor, x_d: torch.Tensor, x_s: torch.Tensor) -> float:
    """E(U, V) = ‖X_d Wᵀ − X_s Vᵀ Uᵀ‖², computed on the activations."""
    return ((x_d @ w.T - x_s @ v.T @ u.T) ** 2).sum().item()


def damped(x: torch.Tensor, lam: float) -> torch.Tensor:
    """The activations with √λ·I appended as rows: least squares on them adds λ‖W − UV‖²."""
    return torch.cat([x, lam**0.5 * torch.eye(x.shape[1], dtype=x.dtype)])


@pytest.mark.parametrize("damp", [0.0, 0.05], ids=["undamped", "damped"])
@pytest.mark.parametrize("method", ["svd", "asvd", "svd-llm"])
def test_each_step_is_the_direct_least_squares_solution(method: str, damp: float) -> None:
    x_d, x_s = activations()
    w = torch.randn(OUT, IN, generator=gen, dtype=torch.float64)
    gram, cross = x_s.T @ x_s, x_d.T @ x_s
    u0, v0 = prepare(w, scaling(method, gram=gram, abs_mean=x_s.abs().mean(0))).factors(RANK, dtype=torch.float64)
    reg = Regression.of(gram, cross, damp)
    target = reg.target(w)
    lam = damp * gram.diagonal().mean().item()
    x_d, x_s = damped(x_d, lam), damped(x_s, lam)  # the problem the update solves, written on activations

    # U with V fixed: min_U ‖X_d Wᵀ − (X_s Vᵀ) Uᵀ‖ — an ordinary least-squares problem in Uᵀ
    u1 = reg.refit_u(target, v0)
    direct_u = torch.linalg.lstsq(x_s @ v0.T, x_d @ w.T).solution.T
    torch.testing.assert_close(u1, direct_u, rtol=1e-7, atol=1e-9)

    # V with U fixed: vec(X_s Vᵀ Uᵀ) = (U ⊗ X_s) vec(Vᵀ) — the same problem written out in full
    v1 = reg.refit_v(target, u1)
    design = torch.kron(u1, x_s)  # (OUT·rows) × (RANK·IN), column-major vec of Vᵀ
    rhs = (x_d @ w.T).T.reshape(-1)  # vec of the (rows × OUT) target, column by column
    direct_v = torch.linalg.lstsq(design, rhs[:, None]).solution.reshape(RANK, IN)
    torch.testing.assert_close(v1, direct_v, rtol=1e-7, atol=1e-9)

    # the calibration output error (damped: E + λ‖W − UV‖²) never increases
    e0, e1, e2 = error(w, u0, v0, x_d, x_s), error(w, u1, v0, x_d, x_s), error(w, u1, v1, x_d, x_s)
    assert e2 <= e1 <= e0 * (1 + 1e-12), (e0, e1, e2)
    assert e2 < (0.95 if damp == 0 else 1.0) * e0, "the target moved (upstream error): the update fixes some"

    # the whole update is those two steps, with the product unchanged by the re-balancing
    u, v = reg.sequential(w, u0, v0)
    torch.testing.assert_close(u @ v, u1 @ v1, rtol=1e-8, atol=1e-10)
    assert error(w, u, v, x_d, x_s) == pytest.approx(e2, rel=1e-9)


def test_damping_pulls_towards_the_dense_matrix() -> None:
    """‖W − UV‖ falls as λ grows, and at a λ that drowns the data the two steps are those of
    ‖W − UV‖ alone: U = W V⁺, then V = U⁺ W."""
    x_d, x_s = activations()
    w = torch.randn(OUT, IN, generator=gen, dtype=torch.float64)
    gram, cross = x_s.T @ x_s, x_d.T @ x_s
    u0, v0 = prepare(w, whitening(gram)).factors(RANK, dtype=torch.float64)
    gaps = []
    for damp in (0.0, 0.1, 10.0, 1e4):
        u, v = Regression.of(gram, cross, damp).sequential(w, u0, v0)
        gaps.append((w - u @ v).norm().item())
    assert gaps == sorted(gaps, reverse=True), gaps
    u1 = torch.linalg.lstsq(v0.T, w.T).solution.T
    v1 = torch.linalg.lstsq(u1, w).solution
    assert gaps[-1] == pytest.approx((w - u1 @ v1).norm().item(), rel=1e-3)


def test_whitened_objective_is_the_output_error() -> None:
    """E_λ(U, V) = ‖X_d Wᵀ‖² + λ‖W‖² − ‖T‖² + ‖T − U V S‖²: the identity both steps rely on."""
    x_d, x_s = activations()
    w = torch.randn(OUT, IN, generator=gen, dtype=torch.float64)
    gram = x_s.T @ x_s
    damp = 0.05
    reg = Regression.of(gram, x_d.T @ x_s, damp)
    lam = damp * gram.diagonal().mean().item()
    target = reg.target(w)
    u = torch.randn(OUT, RANK, generator=gen, dtype=torch.float64)
    v = torch.randn(RANK, IN, generator=gen, dtype=torch.float64)
    whitened = ((x_d @ w.T) ** 2).sum() + lam * (w**2).sum() - (target**2).sum() \
        + ((target - u @ reg.white.apply(v)) ** 2).sum()
    assert whitened.item() == pytest.approx(error(w, u, v, damped(x_d, lam), damped(x_s, lam)), rel=1e-9)


def test_svd_llm_on_its_own_input_is_already_optimal() -> None:
    """SVD-LLM's code refits U against W·X_s; after sequential whitening on the same X_s the
    truncation is the exact rank-r optimum of that error, so the refit changes nothing — the
    reason this update targets the dense model's output instead."""
    _, x_s = activations()
    w = torch.randn(OUT, IN, generator=gen, dtype=torch.float64)
    white = whitening(x_s.T @ x_s)
    u0, v0 = prepare(w, white).factors(RANK, dtype=torch.float64)
    u, v = Regression.of(x_s.T @ x_s, None, damp=0.0).sequential(w, u0, v0)
    torch.testing.assert_close(u @ v, u0 @ v0, rtol=1e-9, atol=1e-10)
    # balanced as the truncation balances them (each column up to its sign)
    torch.testing.assert_close(u.norm(dim=0), u0.norm(dim=0), rtol=1e-8, atol=0)


def test_balanced_splits_the_singular_values_evenly() -> None:
    white = whitening(torch.eye(IN, dtype=torch.float64) * 4.0)
    u = torch.randn(OUT, RANK, generator=gen, dtype=torch.float64) * 10
    v = torch.randn(RANK, IN, generator=gen, dtype=torch.float64) / 10
    bu, bv = balanced(u, v, white)
    torch.testing.assert_close(bu @ bv, u @ v, rtol=1e-10, atol=1e-12)
    sigma = torch.linalg.svdvals(u @ white.apply(v))[:RANK]
    torch.testing.assert_close(bu.norm(dim=0), sigma.sqrt(), rtol=1e-10, atol=0)
    torch.testing.assert_close(white.apply(bv).norm(dim=1), sigma.sqrt(), rtol=1e-10, atol=0)
