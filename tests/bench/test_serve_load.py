"""The load generator's request set and its static-batching comparison: the arrival formula
worked by hand, the request set's statistics, and the static batches run on a tiny model."""

from __future__ import annotations

import statistics

import pytest

from deinfer_megatron.bench.serve_load import (
    LoadRequest,
    LoadSpec,
    make_requests,
    percentiles,
    run_static_batches,
    static_report,
)
from tests.helpers.tiny_models import full_rank_folders


def test_request_set_is_seeded_poisson_with_lengths_in_range() -> None:
    spec = LoadSpec(requests=4000, rate=5.0, prompt_words=(3, 9), output_tokens=(2, 4), seed=3)
    requests = make_requests(spec)
    assert requests == make_requests(spec) and requests != make_requests(LoadSpec(requests=4000, rate=5.0, seed=4))
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(requests, requests[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 5.0, rel=0.05)  # exponential gaps of mean 1/rate
    assert statistics.stdev(gaps) == pytest.approx(1 / 5.0, rel=0.08)  # … whose deviation equals the mean
    assert {len(r.prompt.split()) for r in requests} == set(range(3, 10))
    assert {r.max_tokens for r in requests} == {2, 3, 4}
    with pytest.raises(ValueError, match="--rate"):
        LoadSpec(rate=0)


def test_static_batches_wait_for_their_last_arrival_and_the_previous_batch() -> None:
    requests = [LoadRequest("a", 1, t) for t in (0.0, 1.0, 1.5, 10.0)]
    rows = [{"ttft": 0.25, "e2e": 2.0, "tokens": 3, "batch_s": 2.0}] * 2 + \
           [{"ttft": 0.5, "e2e": 4.0, "tokens": 5, "batch_s": 4.0}] * 2
    report = static_report(requests, rows, concurrency=2)
    # batch 1 starts at 1.0 (its last arrival), ends at 3.0; batch 2 starts at 10.0, ends at 14.0
    assert report["wall_s"] == 14.0 and report["completion_tokens"] == 16
    assert report["throughput_tokens_per_s"] == 16 / 14.0
    # TTFT from each arrival: 1.0 + 0.25, 0 + 0.25, 8.5 + 0.5, 0 + 0.5; end-to-end: 3, 2, 12.5, 4
    assert report["ttft_s"]["p50"] == statistics.median([1.25, 0.25, 9.0, 0.5])
    assert report["e2e_s"]["p50"] == statistics.median([3.0, 2.0, 12.5, 4.0])
    assert report["ttft_s"]["p99"] == 9.0
    assert percentiles([]) == {"p50": None, "p99": None, "mean": None}


def test_static_batches_on_a_tiny_model(tmp_path) -> None:
    _, _, dec = full_rank_folders(tmp_path, "llama")
    requests = make_requests(LoadSpec(requests=5, rate=100, concurrency=2, prompt_words=(2, 6), output_tokens=(2, 5)))
    report = run_static_batches(dec, requests, 2)
    assert report["completed"] == 5
    assert report["completion_tokens"] == sum(r.max_tokens for r in requests)  # each row counts its own
    assert report["ttft_s"]["p50"] <= report["e2e_s"]["p50"]
