"""Token choice rules, checked against their definitions."""

from __future__ import annotations

import pytest
import torch

from deinfer_megatron.generation.sampling import SamplingParams, sample


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(params.seed)
    return torch.stack([sample(logits, params, gen) for _ in range(n)])


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.0, 4.9]])
    assert sample(logits, SamplingParams(), torch.Generator()).tolist() == [1, 0]


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    seen = set(draws(logits, SamplingParams(greedy=False, top_k=2)).flatten().tolist())
    assert seen == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    counts = torch.bincount(draws(logits, SamplingParams(greedy=False, top_p=0.7)).flatten(), minlength=4)
    assert counts[2] == counts[3] == 0  # 0.5 + 0.3 ≥ 0.7: tokens 2, 3 are cut
    assert counts[0] / counts[:2].sum() == pytest.approx(0.5 / 0.8, abs=0.03)


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.4]]))
    cold = draws(logits, SamplingParams(greedy=False, temperature=0.25)).float().mean()
    hot = draws(logits, SamplingParams(greedy=False, temperature=4.0)).float().mean()
    expected_cold = 0.4**4 / (0.6**4 + 0.4**4)  # p ∝ p^(1/T)
    assert cold.item() == pytest.approx(expected_cold, abs=0.03)
    assert hot.item() > 0.45


def test_same_seed_same_draws() -> None:
    logits = torch.randn(3, 50)
    params = SamplingParams(greedy=False, temperature=0.8, top_p=0.9, seed=5)
    assert torch.equal(draws(logits, params, 20), draws(logits, params, 20))


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=0.0), "--temperature must be > 0"),
    (dict(top_k=-1), "--top-k must be ≥ 0"),
    (dict(top_p=1.5), r"--top-p must be in \(0, 1\]"),
])
def test_bad_parameters(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(greedy=False, **kw)
