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
from deinfer_megatron.bench.serve_metrics import MetricsPoller, parse_metrics
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
    report = run_static_batches(dec, requests, 2, profile_chunk=4)
    assert report["completed"] == 5
    assert report["completion_tokens"] == sum(r.max_tokens for r in requests)  # each row counts its own
    assert report["ttft_s"]["p50"] <= report["e2e_s"]["p50"]
    assert 0 < report["cpu_s"] <= report["wall_s"] * 1.05  # one thread: never more CPU than wall time
    profile = report["served_step_profile"]  # a served step on the same rank: its parts add up to it
    for step in ("decode", "mixed"):
        (rank,) = profile[step]
        parts = ("gemm_s", "attention_s", "collective_wait_s", "collective_s", "other_s")
        assert rank["gemm_s"] > 0 and rank["attention_s"] >= rank["cache_s"] > 0 and rank["other_s"] >= 0
        assert rank["collectives"] == 0 and sum(rank[p] for p in parts) == pytest.approx(rank["step_s"])


def test_system_words_start_every_prompt_alike() -> None:
    plain = make_requests(LoadSpec(requests=20, rate=5.0, prompt_words=(3, 9), seed=3))
    shared = make_requests(LoadSpec(requests=20, rate=5.0, prompt_words=(3, 9), seed=3, system_words=6))
    system = shared[0].prompt.split()[:6]
    for a, b in zip(plain, shared):  # the same request set behind the same 6 words
        assert b.prompt.split() == system + a.prompt.split() and b.max_tokens == a.max_tokens
        assert b.arrival_s == a.arrival_s
    with pytest.raises(ValueError, match="--system-words"):
        LoadSpec(system_words=-1)


def test_the_servers_metrics_before_during_and_after_a_run() -> None:
    before = parse_metrics('# HELP x\ndeinfer_steps_total 10.0\ndeinfer_step_tokens_total{kind="decode"} 5.0\n'
                           'deinfer_step_phase_seconds_total{phase="forward"} 1.5\ndeinfer_running_sequences 0.0\n'
                           'deinfer_prefix_cache_queries_total 100.0\ndeinfer_prefix_cache_hits_total 20.0\n')
    assert before['deinfer_step_tokens_total{kind="decode"}'] == 5.0 and "# HELP x" not in before
    poller = MetricsPoller(None, "http://h:1/v1", {})
    assert poller.url == "http://h:1/metrics" and poller.report() == {}
    during = {**before, "deinfer_running_sequences": 7.0}
    after = {**before, "deinfer_steps_total": 30.0, 'deinfer_step_tokens_total{kind="decode"}': 45.0,
             'deinfer_step_phase_seconds_total{phase="forward"}': 4.0, "deinfer_prefix_cache_queries_total": 300.0,
             "deinfer_prefix_cache_hits_total": 120.0}
    for values in (before, during, after):  # what the polls read
        poller.first = poller.first or values
        poller.last = values
        poller.peaks["deinfer_running_sequences"] = max(poller.peaks["deinfer_running_sequences"],
                                                        values["deinfer_running_sequences"])
    report = poller.report()
    assert report["steps"] == 20 and report["decode_tokens"] == 40 and report["peak_running_sequences"] == 7
    assert report["step_phase_s"]["forward"] == 2.5 and report["step_phase_s"]["idle"] is None
    assert report["prefix_cache_hit_ratio"] == pytest.approx(100 / 200)  # of this run's queries only
