"""The ``--calib-self`` sampling loop against independent references: the softmax formula for
its draws, and transformers' greedy generation one prompt at a time (no padding, no rows
leaving the batch) for what the batched loop writes."""

from __future__ import annotations

import torch

from deinfer_megatron.decompose.sampling import draw, sample_rows
from tests.helpers.tiny_models import hf_greedy_alone, random_hf_model


def test_draw_samples_the_tempered_softmax() -> None:
    logits = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0])
    for temperature in (0.5, 1.0, 2.0):
        rows = 60_000
        got = draw(logits.expand(rows, -1), temperature, torch.Generator().manual_seed(1))
        freq = torch.bincount(got, minlength=5).double() / rows
        want = torch.softmax(logits.double() / temperature, -1)
        # 4 standard deviations of a binomial frequency
        assert torch.all((freq - want).abs() <= 4 * (want * (1 - want) / rows).sqrt() + 1e-9), (temperature, freq, want)


def test_draw_near_zero_temperature_is_argmax_and_never_an_impossible_token() -> None:
    logits = torch.randn(500, 97, generator=torch.Generator().manual_seed(0))
    assert torch.equal(draw(logits, 1e-6, torch.Generator().manual_seed(2)), logits.argmax(-1))
    masked = logits.clone()
    masked[:, 50:] = float("-inf")  # probability zero: never drawn, even at u near 1
    assert int(draw(masked, 1.0, torch.Generator().manual_seed(3)).max()) < 50


def test_temperature_zero_is_greedy_and_draws_nothing() -> None:
    logits = torch.randn(64, 33, generator=torch.Generator().manual_seed(8))
    gen = torch.Generator().manual_seed(9)
    before = gen.get_state()
    assert torch.equal(draw(logits, 0, gen), logits.argmax(-1))
    assert torch.equal(gen.get_state(), before), "greedy rows leave the random stream to the sampled ones"


def test_rows_leave_the_batch_without_changing_the_others() -> None:
    """Prompts of different lengths (left padding), an end token that some rows write early
    (their cache rows are dropped mid-way): near zero temperature every row equals
    transformers' greedy continuation of its prompt alone."""
    model = random_hf_model("llama", seed=4, vocab_size=64).eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in (3, 9, 5, 12, 1, 7)]
    free = [hf_greedy_alone(model, p, 14, eos=-1) for p in prompts]
    eos = free[1][4]  # row 1 ends after 5 tokens; rows that write it sooner end sooner
    want = [hf_greedy_alone(model, p, 14, eos) for p in prompts]
    assert len({len(w) for w in want}) > 1, "the case must drop rows at different steps"
    got = sample_rows(model, prompts, max_new_tokens=14, temperature=1e-6, eos_id=eos,
                      generator=torch.Generator().manual_seed(0))
    assert got == want


def test_sampled_rows_follow_the_model_distribution() -> None:
    """At temperature 1 the first token written after a prompt follows the model's own
    next-token softmax (600 rows of the same prompt; frequencies of its 3 likeliest tokens)."""
    model = random_hf_model("llama", seed=6, vocab_size=32).eval()
    prompt = [5, 9, 2, 17]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
    rows = 600
    got = sample_rows(model, [prompt] * rows, max_new_tokens=1, temperature=1.0, eos_id=None,
                      generator=torch.Generator().manual_seed(7))
    freq = torch.bincount(torch.tensor([r[0] for r in got]), minlength=32).double() / rows
    top = probs.topk(3).indices
    sd = (probs[top] * (1 - probs[top]) / rows).sqrt()
    assert torch.all((freq[top] - probs[top]).abs() <= 4 * sd), (freq[top], probs[top])
