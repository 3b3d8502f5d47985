"""The GEMM term prices every matrix product at its own shard's shape: a table of planted
per-shape times gives the formula's block time (arithmetic here, shapes written out by hand from
the layouts' split rules); the per-shape lookup interpolates monotonically in batch rows; a
cache of the previous format is ignored and ``host_table`` measures only the shapes it lacks."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import pytest

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.layers.costs import Gemm
from deinfer_megatron.planning import cost_model, host
from deinfer_megatron.planning.pricing import Workload, choose_layouts, required_gemms
from deinfer_megatron.planning.calibrate import measure_shapes
from deinfer_megatron.planning.cost_model import TableKey, cache_path, load_cached, shape_key, shape_seconds
from deinfer_megatron.specs.rank_config import RankConfig
from tests.helpers.cost_tables import FREE, elements_only, params_only, zero_overhead
from tests.planning.test_auto import CFG, _ranks

BW = 1e10  # bytes/s of a weight read
GRID = (1, 8, 64)  # batch rows planted


def rate(g: Gemm) -> float:
    """A FLOP rate that differs from shape to shape."""
    return 1e9 * (1 + (g.k + g.n + g.count) % 5)


def planted(g: Gemm, m: float) -> float:
    """The planted time: weights from memory, or the FLOPs at the shape's rate if slower."""
    return max(4 * g.weights / BW, 2 * m * g.weights / rate(g))


def _table(arch, ranks, tp: int):
    """Free collectives, memory (KV reads) and overhead; every needed shape planted at GRID."""
    needs = {g for b in GRID for g, _ in required_gemms(arch, ranks, Workload(tp=tp, batch=b))}
    shapes = {shape_key("float32", g): [[float(m), planted(g, m)] for m in GRID] for g in needs}
    return replace(elements_only(), collectives={"all_reduce": [0.0, FREE], "all_gather": [0.0, FREE]},
                   gemm=params_only().gemm, shapes=shapes)


# Layer 0 of the tiny llama (h 64, I 96) with every rank 8, on rank 0 of TP 2, from the split rules:
# DeInfer fc1: V of gate|up (16 rows) gathered, 8 per rank; U rows split (48), one bmm of 2;
#          fc2: V's input split (48 of 96), U_down replicated.
# naive   fc1: each section's V rows split (4 + 4); U columns split (4), full rows, bmm of 2;
#          fc2: V rows split (4), U columns split (4).
# dense   fc1: W rows split (2 × 48), fc2: input split (48); both F.linear on (out, in) weights.
MLP_SHAPES = {
    "deinfer": [Gemm(64, 8), Gemm(8, 48, 2), Gemm(48, 8), Gemm(8, 64)],
    "naive": [Gemm(64, 8), Gemm(4, 96, 2), Gemm(96, 4), Gemm(4, 64)],
    "dense": [Gemm(64, 96, transposed=True), Gemm(48, 64, transposed=True)],
}


@pytest.mark.parametrize("batch", [8, 4], ids=["on-grid", "interpolated"])
def test_block_gemm_is_the_sum_over_its_shapes(batch: int) -> None:
    arch = arch_from_hf_config(CFG)
    ranks = RankConfig.from_mapping(_ranks(), arch)
    choice = choose_layouts(arch, ranks, Workload(tp=2, batch=batch), _table(arch, ranks, 2))

    def at(g: Gemm) -> float:  # linear in rows between the planted 1 and 8
        f = (batch - 1) / (8 - 1)
        return planted(g, 1) * (1 - f) + planted(g, 8) * f

    for layout, shapes in MLP_SHAPES.items():
        assert choice.seconds[0]["mlp"][layout] == pytest.approx(sum(at(g) for g in shapes), rel=1e-12), layout
    # the output layer: F.linear by the padded vocabulary's rows on a rank (101 → 102 / 2)
    assert choice.outside_s == pytest.approx(at(Gemm(64, 51, transposed=True)), rel=1e-12)


def test_per_shape_lookup_interpolates_monotonically() -> None:
    rows = [[1.0, 1e-3], [8.0, 0.8e-3], [32.0, 4e-3]]  # a noisy 8 measured below 1
    values = [shape_seconds(rows, m) for m in range(1, 65)]
    assert all(b >= a for a, b in zip(values, values[1:])), "more rows never cost less"
    assert shape_seconds(rows, 0.5) == shape_seconds(rows, 4) == 1e-3
    assert shape_seconds(rows, 20) == pytest.approx(1e-3 + 3e-3 * 12 / 24)
    assert shape_seconds(rows, 64) == pytest.approx(4e-3 + 3e-3 / 24 * 32), "the last segment's slope"
    assert shape_seconds([[8.0, 2e-3]], 32) == pytest.approx(8e-3), "one measurement: proportional"


def test_previous_format_ignored_and_only_missing_shapes_measured(tmp_path, monkeypatch) -> None:
    key = TableKey.current(1)
    old = asdict(replace(params_only(), key=replace(key, format=2)))
    del old["shapes"]
    path = cache_path(key, tmp_path)
    path.write_text(json.dumps(old))
    assert cost_model.FORMAT > 2 and load_cached(path, key) is None
    asked = []

    def fake(dtype, needs, *, threads):
        needs = set(needs)
        asked.append(needs)
        return {g: [[float(m), 1e-6 * m] for gg, m in sorted(needs) if gg == g] for g, _ in needs}

    monkeypatch.setattr("deinfer_megatron.planning.calibrate.measure_shapes", fake)
    monkeypatch.setattr("deinfer_megatron.planning.calibrate.calibrate",
                        lambda k, *, collectives: replace(params_only(), key=k))
    monkeypatch.setattr("deinfer_megatron.planning.overhead.measure_overhead",
                        lambda t, tp: zero_overhead(tp)[str(tp)])
    g = Gemm(2048, 901)
    host.host_table(tp=2, threads=1, root=tmp_path, gemms={(g, 8)})
    assert len(asked) == 2 and asked[1] == {(g, 8)}, "the overhead fit's shapes, then the plan's"
    host.host_table(tp=2, threads=1, root=tmp_path, gemms={(g, 8)})
    assert len(asked) == 2, "cached: not measured again"
    table = host.host_table(tp=2, threads=1, root=tmp_path, gemms={(g, 8), (g, 32)})
    assert asked[2] == {(g, 32)}
    assert load_cached(path, key).shapes[shape_key("float32", g)] == [[8.0, 8e-6], [32.0, 32e-6]] == \
        table.shapes[shape_key("float32", g)]


def test_measure_shapes_times_every_call_kind() -> None:
    """The real measurement, at small shapes: a time per rows, growing with the FLOPs."""
    shapes = (Gemm(64, 32), Gemm(32, 64, 2), Gemm(64, 48, transposed=True))
    got = measure_shapes("float32", {(g, m) for g in shapes for m in (1, 64)}, threads=1)
    assert set(got) == set(shapes)
    for g in shapes:
        assert [r[0] for r in got[g]] == [1.0, 64.0]
        assert all(math.isfinite(t) and 0 < t < 0.1 for _, t in got[g]), got[g]


class PassClock:
    """A ``perf_counter`` for code that reads it twice per pass (start, end): pass i lasts
    ``durations[i % len]`` seconds, whatever the calls inside it did."""

    def __init__(self, durations: list[float]) -> None:
        self.durations, self.now, self.reads = durations, 0.0, 0

    def __call__(self) -> float:
        if self.reads % 2:  # an end: the pass's scripted length
            self.now += self.durations[(self.reads // 2) % len(self.durations)]
        self.reads += 1
        return self.now


@pytest.mark.parametrize("durations", [[5.0, 1.0, 3.0, 9.0, 2.0], [3.0, 1.0, 9.0, 2.0, 5.0]])
def test_measure_shapes_keeps_the_median_pass(durations, monkeypatch) -> None:
    """Five passes per (shape, rows) and their median kept: the typical pass a decode step meets,
    not the fastest (a table of fastest passes predicted the median step at 0.54-0.70). Scripted
    passes of the same median give the time of five passes of exactly that length."""
    from deinfer_megatron.planning import calibrate

    g = Gemm(64, 32)
    monkeypatch.setattr(calibrate.time, "perf_counter", PassClock([3.0] * 5))
    even = calibrate.measure_shapes("float32", {(g, 8)}, threads=1)[g]
    monkeypatch.setattr(calibrate.time, "perf_counter", PassClock(durations))
    got = calibrate.measure_shapes("float32", {(g, 8)}, threads=1)[g]
    assert calibrate.ROUNDS == 5 and got == even and even[0][1] > 0
