"""The attention over a decode step's cache, timed per core, heads, batch and context
(``calibrate.measure_attention``) and priced from those timings (``CostTable.attention_seconds``).

The standalone cores are checked against each other and against a formula: Megatron's
``DotProductAttention`` built alone over a rank's heads computes what this project's attention
computes, and both against attention written out per head — so what is timed is the attention
the blocks run, not something of the same shape."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.layers.core_attention import MEGATRON, SDPA, standalone_core
from deinfer_megatron.layers.costs import Attend, Cost
from deinfer_megatron.planning import calibrate, cost_model, host
from deinfer_megatron.planning.pricing import Workload, block_seconds, choose_layouts, required_attention
from deinfer_megatron.planning.cost_model import (ATTENTION_COPY_BYTES, TableKey, attention_batch,
                                                 attention_key, load_cached, cache_path)
from deinfer_megatron.specs.rank_config import RankConfig
from tests.helpers.cost_tables import (fake_measure_attention, fake_measure_shapes, params_only,
                                       zero_overhead)
from tests.helpers.tiny_models import TINY_CONFIGS


def _rotated(k: torch.Tensor) -> torch.Tensor:
    """``[sk, b, n, d]`` keys rotated by their position (RoPE, base 10000, the halves of each
    head paired: Hugging Face LLaMA's ``rotate_half`` convention), in float64."""
    sk, d = k.shape[0], k.shape[-1]
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(sk, dtype=torch.float64)[:, None] * inv[None]  # [sk, d/2]
    cos, sin = (f(angle).repeat(1, 2)[:, None, None] for f in (torch.cos, torch.sin))
    x = k.double()
    half = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    return x * cos + half * sin


@pytest.mark.parametrize("core, rotary", [(SDPA, False), (MEGATRON, False), (MEGATRON, True)])
def test_a_standalone_core_attends_as_written_out_per_head(core, rotary) -> None:
    """With ``rotary`` (Megatron's static-batching attention, whose cache holds keys before
    RoPE) the timed call rotates every key by its position before attending."""
    from megatron.core import parallel_state

    attend = Attend(core, heads=6, kv_heads=2, head_dim=8, rotary=rotary)
    gen = torch.Generator().manual_seed(4)
    b, sk = 3, 9
    q = torch.randn(1, b, 6, 8, generator=gen)
    k, v = torch.randn(sk, b, 2, 8, generator=gen), torch.randn(sk, b, 2, 8, generator=gen)
    with torch.no_grad(), standalone_core(attend, torch.float32) as run:
        got = run(q, k, v).reshape(1, b, 6, 8)
    assert parallel_state._GLOBAL_MEMORY_BUFFER is None, "the buffer set up for the timing is taken down"
    keys = _rotated(k) if rotary else k.double()
    want = torch.empty(1, b, 6, 8, dtype=torch.float64)
    for s in range(b):
        for h in range(6):
            scores = keys[:, s, h // 3] @ q[0, s, h].double() / math.sqrt(8)
            want[0, s, h] = scores.softmax(0) @ v[:, s, h // 3].double()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_measured_attention_grows_with_the_context_and_is_cached_per_case() -> None:
    """Real timings of both cores at two contexts: one row per case, positive, and the longer
    cache the slower (16 times the tokens, well beyond a timer's noise)."""
    cases = {(Attend(c, 4, 2, 16), 2, n) for c in (SDPA, MEGATRON) for n in (64, 1024)}
    got = calibrate.measure_attention("float32", cases, threads=1)
    assert set(got) == {Attend(SDPA, 4, 2, 16), Attend(MEGATRON, 4, 2, 16)}
    for attend, rows in got.items():
        assert [(b, c) for b, c, _ in rows] == [(2.0, 64.0), (2.0, 1024.0)], attend
        short, long = rows[0][2], rows[1][2]
        assert 0 < short < long, attend


def test_pricing_takes_the_timing_scaled_by_the_batch_else_the_bytes() -> None:
    attend = Attend(SDPA, 16, 4, 64)
    table = params_only()
    work = Workload(tp=2, batch=8, context=2048)
    untimed = table.attention_seconds("float32", attend, 8, 2048)
    assert untimed == pytest.approx(8 * 2048 * 2 * 4 * 64 * 4 / table.memory_bytes_per_s)
    timed = replace(table, attention={attention_key("float32", attend): [[8.0, 2048.0, 0.012]]})
    assert timed.attention_seconds("float32", attend, 8, 2048) == pytest.approx(0.012)
    assert timed.attention_seconds("float32", attend, 8, 1024) == pytest.approx(8 * 1024 * 2 * 4 * 64 * 4 / table.memory_bytes_per_s), \
        "another context is not priced from this one's timing"
    cost = Cost(attends=(attend, attend))
    assert block_seconds(timed, cost, work) == pytest.approx(0.024), "each attend of the block is priced"
    assert block_seconds(timed, cost, work, latent_bytes_per_token=100) == pytest.approx(
        8 * 2048 * 100 / table.memory_bytes_per_s), "the latent cache is priced by its bytes"
    # a batch whose K/V outgrow one timed call is timed at fewer sequences and scaled
    per_sequence = 2 * 2048 * 4 * 64 * 4
    big = 4 * ATTENTION_COPY_BYTES // per_sequence
    few = attention_batch("float32", attend, big, 2048)
    assert few == ATTENTION_COPY_BYTES // per_sequence and few < big
    scaled = replace(table, attention={attention_key("float32", attend): [[float(few), 2048.0, 0.5]]})
    assert scaled.attention_seconds("float32", attend, big, 2048) == pytest.approx(0.5 * big / few)


def test_auto_prices_every_layouts_attention_at_the_context() -> None:
    """The plan's choice follows the timed attention: make dense's attention (Megatron's core)
    cost a second and the others nothing, and no attention block is dense; then the reverse."""
    arch = arch_from_hf_config(TINY_CONFIGS["llama"])
    ranks = RankConfig.from_mapping({n: 4 for n in arch.linear_shapes()}, arch)
    work = Workload(tp=2, batch=2, context=40)
    needs = required_attention(arch, ranks, work)
    assert {a.core for a, _, _ in needs} == {SDPA, MEGATRON}
    assert all((b, c) == (2, 40) for _, b, c in needs)

    def priced(slow: str):
        rows = {attention_key("float32", a): [[2.0, 40.0, 1.0 if a.core == slow else 0.0]] for a, _, _ in needs}
        table = replace(params_only(), overhead=zero_overhead(2), attention=rows)
        return {b.attention.value for b in choose_layouts(arch, ranks, work, table).plan.layers}

    assert "dense" not in priced(MEGATRON)
    assert priced(SDPA) == {"dense"}


def test_host_table_times_missing_attention_once(tmp_path, monkeypatch) -> None:
    timed = []
    monkeypatch.setattr("deinfer_megatron.planning.calibrate.measure_shapes", fake_measure_shapes)
    monkeypatch.setattr("deinfer_megatron.planning.calibrate.measure_attention",
                        lambda d, cases, *, threads: timed.append(set(cases)) or fake_measure_attention(d, cases, threads=threads))
    key = TableKey.current(1)
    cost_model.save(replace(params_only(), key=key, overhead=zero_overhead(2)), cache_path(key, tmp_path))
    need = {(Attend(SDPA, 4, 2, 16), 3, 100)}
    table = host.host_table(tp=2, threads=1, root=tmp_path, attention=need)
    assert timed == [need]
    assert table.attention_seconds("float32", Attend(SDPA, 4, 2, 16), 3, 100) == pytest.approx(1e-9 * 300)
    assert load_cached(cache_path(key, tmp_path), key) == table, "cached for the next job"
    host.host_table(tp=2, threads=1, root=tmp_path, attention=need)
    assert len(timed) == 1, "a timed case is not timed again"


def test_measured_attention_keeps_the_median_pass(monkeypatch) -> None:
    """As for the products: the median of the passes, not the fastest."""
    from tests.planning.test_gemm_shapes import PassClock

    case = (Attend(SDPA, 4, 2, 16), 2, 64)
    monkeypatch.setattr(calibrate.time, "perf_counter", PassClock([3.0] * 5))
    even = calibrate.measure_attention("float32", {case}, threads=1)
    monkeypatch.setattr(calibrate.time, "perf_counter", PassClock([5.0, 1.0, 3.0, 9.0, 2.0]))
    assert calibrate.measure_attention("float32", {case}, threads=1) == even
