"""The optimizer pieces in one process, against their formulas and torch's own clipping."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from deinfer_megatron.training import OptimizerConfig, clip_by_global_norm, make_optimizer
from tests.helpers.training import cosine_lr


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=0.0), "lr must be a positive number"),
    (dict(lr=1e-3, min_lr=1e-2), "min_lr must be between 0 and lr"),
    (dict(total_steps=0), "total_steps must be at least 1"),
    (dict(total_steps=10, warmup_steps=10), "warmup_steps must be ≥ 0 and below total_steps"),
    (dict(clip_grad=-1.0), "clip_grad must be ≥ 0"),
    (dict(betas=(0.9, 1.0)), r"betas must lie in \[0, 1\)"),
])
def test_bad_settings_are_refused_in_one_line(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match) as err:
        OptimizerConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_learning_rate_is_warm_up_then_cosine() -> None:
    cfg = OptimizerConfig(lr=2e-3, min_lr=1e-4, warmup_steps=3, total_steps=10)
    optimizer, scheduler = make_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
    got = []
    for _ in range(12):
        scheduler.step(1)  # as Trainer.optimizer_step does before each update
        got.append(optimizer.param_groups[0]["lr"])
    want = [cosine_lr(n, 2e-3, 3, 10, 1e-4) if n <= 10 else 1e-4 for n in range(1, 13)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[0] == pytest.approx(2e-3 / 3)  # the first step already moves the weights


def test_clipping_matches_torch_and_measures_without_clipping() -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7))]
    grads = [torch.randn(p.shape, generator=gen, dtype=torch.float32) for p in params]
    for p in params:  # split parameters are counted on every rank (no process group needed)
        set_tensor_model_parallel_attributes(p, True, 0, 1)
    twins = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    for p, t, g in zip(params, twins, grads):
        p.grad, t.grad = g.clone(), g.clone()
    norm = clip_by_global_norm(params, 0.5, None, None)
    want = torch.nn.utils.clip_grad_norm_(twins, 0.5)
    assert norm == pytest.approx(float(want), rel=1e-6)
    assert norm == pytest.approx(math.sqrt(sum(float(g.pow(2).sum()) for g in grads)), rel=1e-6)
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.grad, t.grad)
    before = [p.grad.clone() for p in params]
    assert clip_by_global_norm(params, 0.0, None, None) == pytest.approx(0.5, rel=1e-5)
    for p, b in zip(params, before):
        assert torch.equal(p.grad, b)  # clip 0: measured, not scaled


def test_a_rank_without_parameters_still_follows_the_schedule() -> None:
    optimizer, scheduler = make_optimizer([], OptimizerConfig(lr=1e-3, warmup_steps=2, total_steps=5))
    assert optimizer is None
    scheduler.step(1)
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)
