"""``loadgen --peers``: each peer's greedy tokens against transformers' ``generate`` on each
request alone, the CTranslate2 conversion's cache, and the side-by-side report worked by hand."""

from __future__ import annotations

import statistics

import pytest
import torch

from deinfer_megatron.bench import load_peers
from deinfer_megatron.bench.load_compare import compare, text_table
from deinfer_megatron.bench.load_peer_worker import row_timing
from deinfer_megatron.bench.load_peers import LoadPeer, run_load_peer
from deinfer_megatron.bench.serve_load import LoadRequest, LoadSpec, encode_requests, make_requests, static_report
from deinfer_megatron.models.hf_factored import hf_model
from tests.helpers.tiny_models import full_rank_folders

EOS = 2  # the tiny models' end-of-sequence token (SmolLM2's tokenizer)


def _alone(model: torch.nn.Module, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` on one prompt, cut after its end-of-sequence token."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_tokens, eos_token_id=EOS, pad_token_id=EOS)
    tokens = out[0, len(prompt):].tolist()
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny LLaMA decomposed at full rank, and a request set of unequal prompts and outputs."""
    _, _, dec = full_rank_folders(tmp_path_factory.mktemp("peers"), "llama")
    requests = make_requests(LoadSpec(requests=5, rate=100.0, concurrency=3, prompt_words=(2, 9),
                                      output_tokens=(3, 7), seed=5))
    return dec, requests


def test_hf_peer_equals_generate_on_each_request_alone(tiny) -> None:
    dec, requests = tiny
    report, tokens = run_load_peer(LoadPeer.HF, dec, requests, 3, threads=1)
    encoded, _ = encode_requests(dec, requests)
    assert len({len(p) for p, _ in encoded[:3]}) > 1  # a batch of unequal prompts: left padding matters
    model = hf_model(dec, verify=False)
    assert tokens == [_alone(model, p, m) for p, m in encoded]
    assert report["completion_tokens"] == sum(map(len, tokens)) and report["completed"] == 5
    assert report["threads"] == 1 and report["peak_rss_bytes"] > 0 and report["cpu_s"] > 0
    assert report["ttft_s"]["p50"] <= report["e2e_s"]["p50"] and report["tpot_s"]["p50"] > 0


def test_ctranslate2_peer_equals_transformers_on_the_multiplied_out_model(tiny, tmp_path, monkeypatch) -> None:
    dec, requests = tiny
    monkeypatch.setenv("DEINFER_MEGATRON_CACHE", str(tmp_path / "cache"))
    report, tokens = run_load_peer(LoadPeer.CTRANSLATE2, dec, requests, 3, threads=1)
    encoded, _ = encode_requests(dec, requests)
    dense = hf_model(dec, multiply_out=True, verify=False)
    assert tokens == [_alone(dense, p, m) for p, m in encoded]
    assert report["dtype"] == "float32" and report["completion_tokens"] == sum(map(len, tokens))
    # converted once, into the cache, through a staged folder (nothing else left beside it)
    (converted,) = (tmp_path / "cache" / "ctranslate2").iterdir()
    assert converted.name.startswith(f"{dec.name}-") and sorted(p.name for p in converted.iterdir()) == ["ct2"]
    stamp = (converted / "ct2" / "model.bin").stat().st_mtime_ns
    assert load_peers.ctranslate2_model(dec) == converted / "ct2"
    assert (converted / "ct2" / "model.bin").stat().st_mtime_ns == stamp  # taken from the cache


def test_a_rows_tokens_and_times() -> None:
    marks = [10.5, 11.0, 11.25, 11.5, 11.75]  # when each step's token was chosen
    row = row_timing(marks, 10.0, [7, 8, EOS, 9, 9], 5, (EOS,))
    assert row == {"ttft": 0.5, "last": 1.25, "tokens": 3, "token_ids": [7, 8, EOS]}  # EOS counted, then cut
    assert row_timing(marks, 10.0, [7, 8, 9, 9, 9], 2, (EOS,))["last"] == 1.0  # its own max_tokens


def test_side_by_side_report_from_hand_made_timestamps() -> None:
    requests = [LoadRequest("a", 4, t) for t in (0.0, 1.0, 2.0, 2.5)]
    # two batches of two; per row: first token and last token after the batch's start, tokens
    rows = [{"ttft": 0.5, "last": 2.0, "tokens": 4, "batch_s": 3.0, "batch_cpu_s": 2.5},
            {"ttft": 1.0, "last": 1.5, "tokens": 2, "batch_s": 3.0, "batch_cpu_s": 2.5},
            {"ttft": 0.25, "last": 0.25, "tokens": 1, "batch_s": 1.0, "batch_cpu_s": 0.5},
            {"ttft": 0.25, "last": 0.75, "tokens": 3, "batch_s": 1.0, "batch_cpu_s": 0.5}]
    peer = static_report(requests, rows, concurrency=2)
    # batch 1 runs 1.0 → 4.0 (its last arrival), batch 2 runs 4.0 → 5.0 (after batch 1)
    assert peer["wall_s"] == 5.0 and peer["completion_tokens"] == 10 and peer["cpu_s"] == 3.0
    assert peer["ttft_s"]["p50"] == statistics.median([1.5, 1.0, 2.25, 1.75])
    assert peer["ttft_s"]["p99"] == 2.25
    # TPOT: (last − first) ÷ (tokens − 1); a one-token row has none
    assert peer["tpot_s"]["p50"] == statistics.median([1.5 / 3, 0.5 / 1, 0.5 / 2])
    assert peer["e2e_s"]["p50"] == statistics.median([4.0, 3.0, 3.0, 2.5]) and peer["e2e_s"]["p99"] == 4.0
    peer["peak_rss_bytes"] = 3 * 2**20
    server = {"completion_tokens": 10, "wall_s": 2.5, "throughput_tokens_per_s": 4.0,
              "ttft_s": peer["ttft_s"], "tpot_s": peer["tpot_s"], "e2e_s": peer["e2e_s"],
              "metrics": {"thread_cpu_s": {"model_loop": 1.0, "http": 0.25}, "peak_rss_bytes": 2**20}}
    out = compare({"server": server, "peers": {"hf": peer, "ctranslate2": {"error": "RuntimeError: failed"}}})
    assert list(out["sides"]) == ["server", "hf"]  # a failed peer has no row
    assert out["sides"]["server"]["cpu_s"] == 1.25 and out["sides"]["server"]["tokens_per_cpu_s"] == 8.0
    assert out["sides"]["hf"]["tokens_per_cpu_s"] == 10 / 3.0 and out["sides"]["hf"]["peak_rss_bytes"] == 3 * 2**20
    assert out["server_over"]["hf"] == {"throughput": 4.0 / 2.0, "per_cpu_s": 8.0 / (10 / 3.0)}
    lines = text_table(out)
    assert lines[2].split()[:4] == ["hf", "2.0", "3.3", "3.0"] and lines[-1].startswith("server / hf: 2.00×")
