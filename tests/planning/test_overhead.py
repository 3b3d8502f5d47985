"""Framework overhead in the cost model: the predicted step is the formula's, by arithmetic done
here; auto's choice follows the overhead where it dominates; the fit recovers known fixed costs
from timings made of them; a cache of the previous format is ignored; and the real calibration
on two local ranks gives a complete, non-negative entry."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import pytest

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.planning import cost_model, host, overhead
from deinfer_megatron.planning.pricing import Workload, choose_layouts
from deinfer_megatron.planning.cost_model import TableKey, cache_path, load_cached
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig
from tests.helpers.cost_tables import elements_only, fake_measure_attention, fake_measure_shapes, latency_only, params_only, zero_overhead
from tests.planning.test_auto import ATTN, CFG, MLP, _ranks, expected_by_elements

LAT = 1e-4  # every collective's latency
BLOCKS = {"deinfer": {"attention": 3e-3, "mlp": 2e-3}, "naive": {"attention": 5e-3, "mlp": 4e-3},
          "dense": {"attention": 1e-3, "mlp": 7e-4}}
LAYER, OUTSIDE = 2e-4, 6e-3


def _model():
    arch = arch_from_hf_config(CFG)
    return arch, RankConfig.from_mapping(_ranks(), arch)


def test_predicted_step_is_the_formula() -> None:
    """4 layers: 0 and 2 decomposed, 1 and 3 dense. At TP 2, per DESIGN.md §3, a decomposed layer
    issues 2 + 2 collectives in DeInfer, 4 + 3 in naive, 1 + 1 dense (a dense layer: 1 + 1 in every
    layout, and its blocks pay dense's overhead); outside the layers Megatron's embedding
    all-reduce and logits all-gather, the fixed outside time and 4 × the per-layer time."""
    arch, ranks = _model()
    table = latency_only(LAT, {"2": {"blocks": BLOCKS, "layer": LAYER, "outside": OUTSIDE}})
    choice = choose_layouts(arch, ranks, Workload(tp=2, batch=8, context=64), table)
    dense_layer = BLOCKS["dense"]["attention"] + BLOCKS["dense"]["mlp"] + 2 * LAT
    outside = OUTSIDE + 4 * LAYER + 2 * LAT
    want = {
        "deinfer": 2 * (BLOCKS["deinfer"]["attention"] + BLOCKS["deinfer"]["mlp"] + 4 * LAT) + 2 * dense_layer,
        "naive": 2 * (BLOCKS["naive"]["attention"] + BLOCKS["naive"]["mlp"] + 7 * LAT) + 2 * dense_layer,
        "dense": 4 * dense_layer,
    }
    for layout, seconds in want.items():
        assert choice.fixed_step_seconds(Layout(layout)) == pytest.approx(seconds + outside, rel=1e-9, abs=1e-12), layout
    # dense has the least overhead and the fewest collectives in every block here
    assert {b.attention.value for b in choice.plan.layers} == {"dense"}
    assert choice.step_seconds == pytest.approx(want["dense"] + outside, rel=1e-9)


def test_auto_follows_the_overhead_where_it_dominates() -> None:
    """The elements-only table picks by elements per token (test_auto); an overhead of a second
    on every layout but one moves every decomposed block to that one, dense blocks staying dense."""
    arch, ranks = _model()
    work = Workload(tp=2, batch=8, context=64)
    before = [(b.attention.value, b.mlp.value) for b in choose_layouts(arch, ranks, work, elements_only()).plan.layers]
    assert before == [(expected_by_elements(i, ATTN, 2), expected_by_elements(i, MLP, 2)) for i in range(4)]
    for cheap in BLOCKS:
        blocks = {l: {b: 0.0 if l == cheap else 1.0 for b in ("attention", "mlp")} for l in BLOCKS}
        table = replace(elements_only(), overhead={"2": {"blocks": blocks, "layer": 0.0, "outside": 0.0}})
        got = [(b.attention.value, b.mlp.value) for b in choose_layouts(arch, ranks, work, table).plan.layers]
        assert got == [(cheap, cheap), ("dense", "dense"), (cheap, cheap), ("dense", "dense")], cheap
        assert cheap == "dense" or got != before, "the overhead, not the elements, decided"
    # the overhead of another TP size is not this one's
    table = replace(elements_only(), overhead={"4": {"blocks": BLOCKS, "layer": 1.0, "outside": 1.0}})
    assert [(b.attention.value, b.mlp.value) for b in choose_layouts(arch, ranks, work, table).plan.layers] == before


def test_fit_recovers_known_fixed_costs() -> None:
    """Timings made of the table's own price + a fixed cost + a slope in parameters give back
    the fixed cost (the extrapolation to zero size)."""
    from deinfer_megatron.arch.model import transformer_config
    from deinfer_megatron.parallel.topology import TPView
    from deinfer_megatron.planning.pricing import layout_costs, outside_seconds

    table, tp, slope = params_only(), 2, 3e-9
    work = Workload(tp=tp, batch=1, context=overhead.PROMPT + overhead.NEW_TOKENS // 2)
    measured = {}
    for s, size in enumerate(overhead.sizes(tp)):
        arch, rank_config, _ = overhead._model(size)
        priced = choose_layouts(arch, rank_config, work, table).seconds[0]
        config = transformer_config(arch, tp=tp, pp=1)
        for layout in BLOCKS:
            costs = layout_costs(config, arch, Layout(layout), rank_config.layers[0], TPView(0, tp))
            parts = {b: priced[b][layout] + BLOCKS[layout][b] + slope * c.params
                     for b, c in zip(("attention", "mlp"), costs)}
            parts["layer"] = LAYER + slope * arch.hidden_size
            parts["outside"] = outside_seconds(table, arch, work) + OUTSIDE + slope * arch.vocab_size * arch.hidden_size
            measured[f"{s}/{layout}"] = parts
    got = overhead.fit(table, tp, measured)
    for layout in BLOCKS:
        for b in ("attention", "mlp"):
            assert got["blocks"][layout][b] == pytest.approx(BLOCKS[layout][b], rel=1e-6), (layout, b)
    assert got["layer"] == pytest.approx(LAYER, rel=1e-6) and got["outside"] == pytest.approx(OUTSIDE, rel=1e-6)
    assert overhead.intercept(2.0, 1.0, 1.0, 2.0) == 2.0, "a line sloping down is clamped to the larger value"
    assert overhead.intercept(-1.0, -0.5, 1.0, 2.0) == 0.0


def test_cache_of_the_previous_format_is_ignored(tmp_path, monkeypatch) -> None:
    """A format-1 table (no overhead) is not trusted; host_table measures again, overhead included."""
    key = TableKey.current(1)
    old = asdict(replace(params_only(), key=replace(key, format=1)))
    del old["overhead"]
    path = cache_path(key, tmp_path)
    path.write_text(json.dumps(old))
    assert cost_model.FORMAT == 7 and load_cached(path, key) is None
    # nor is a complete format-3 table (its collectives and fixed times were timed with hot
    # caches), format-4 one (its fixed times hold the attention, now timed on its own),
    # format-5 one (its fixed times hold the waits for a peer still flushing its caches) or
    # format-6 one (above TP 4 its fixed times lack the dense layout's)
    for old_format in (3, 4, 5, 6):
        stale = cache_path(key, tmp_path / f"format{old_format}")
        cost_model.save(replace(params_only(), key=replace(key, format=old_format), overhead=zero_overhead(2)), stale)
        assert load_cached(stale, key) is None
    measured = []
    monkeypatch.setattr("deinfer_megatron.planning.calibrate.measure_shapes", fake_measure_shapes)
    monkeypatch.setattr("deinfer_megatron.planning.calibrate.measure_attention", fake_measure_attention)
    monkeypatch.setattr("deinfer_megatron.planning.calibrate.calibrate",
                        lambda k, *, collectives: replace(params_only(), key=k))
    monkeypatch.setattr("deinfer_megatron.planning.overhead.measure_overhead",
                        lambda t, tp: measured.append(tp) or zero_overhead(tp)[str(tp)])
    table = host.host_table(tp=2, threads=1, root=tmp_path)
    assert measured == [2] and table.overhead == zero_overhead(2)
    assert load_cached(path, key) == table
    host.host_table(tp=4, threads=1, root=tmp_path)  # another TP size: its own overhead, once
    host.host_table(tp=4, threads=1, root=tmp_path)
    assert measured == [2, 4] and set(load_cached(path, key).overhead) == {"2", "4"}


@pytest.mark.parametrize("tp", [*range(1, 13), 16, 64])
def test_calibration_models_split_at_every_tp_size(tp: int) -> None:
    """The models that measure the fixed times at TP ``tp`` are ones Megatron and the project
    split at ``tp`` in every layout, dense included (a KV head per rank), and their plans price;
    at TP 1, 2 and 4 they are the shapes every earlier table was measured on."""
    from deinfer_megatron.arch.model import transformer_config
    from deinfer_megatron.parallel.topology import check_parallel_sizes

    configs = overhead.sizes(tp)
    assert len(configs) == 2
    for size in configs:
        arch, rank_config, _ = overhead._model(size)
        check_parallel_sizes(arch, tp, 1)  # the project's own check: valid TP sizes
        transformer_config(arch, tp=tp, pp=1)  # Megatron's: heads and KV heads split by TP
        assert arch.num_kv_heads >= max(tp, overhead.MIN_KV_HEADS) and arch.num_kv_heads % tp == 0
        assert arch.hidden_size % arch.num_heads == 0 and (arch.hidden_size // arch.num_heads) % 2 == 0
    assert configs[1]["hidden_size"] == 2 * configs[0]["hidden_size"]
    assert overhead._layouts() == ("deinfer", "naive", "dense")
    work = overhead._fit_workload(tp)
    arch, rank_config, _ = overhead._model(configs[0])
    choice = choose_layouts(arch, rank_config, work, params_only())
    assert set(choice.seconds[0]["attention"]) == {"deinfer", "naive", "dense"}
    if tp in (1, 2, 4):
        assert [(c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"], c["intermediate_size"])
                for c in configs] == [(8, 4, 64, 176), (8, 4, 128, 352)]


def test_a_failed_calibration_is_one_line_and_auto_falls_back(tmp_path, monkeypatch, caplog) -> None:
    """Whatever stops the measurement (here a measuring rank's multi-line failure), ``host_table``
    raises one line naming what it measured and why it stopped, caches nothing, and ``auto``
    builds the fixed fallback layout with one warning line instead of failing the job."""
    import logging

    from deinfer_megatron.launch.local import RankFailed
    from deinfer_megatron.planning.auto import FALLBACK, auto_plan

    def broken(table, tp):
        raise RankFailed("rank 1 failed with ValueError: heads do not split\nTraceback (most recent call last):\n  ...")

    monkeypatch.setattr("deinfer_megatron.planning.calibrate.measure_shapes", fake_measure_shapes)
    monkeypatch.setattr("deinfer_megatron.planning.calibrate.measure_attention", fake_measure_attention)
    monkeypatch.setattr("deinfer_megatron.planning.calibrate.calibrate",
                        lambda k, *, collectives: replace(params_only(), key=k))
    monkeypatch.setattr("deinfer_megatron.planning.overhead.measure_overhead", broken)
    with pytest.raises(host.CalibrationFailed) as err:
        host.host_table(tp=3, threads=1, root=tmp_path)
    assert "\n" not in str(err.value) and "framework time at TP=3" in str(err.value)
    assert str(err.value).endswith("RankFailed: rank 1 failed with ValueError: heads do not split")
    assert not list(tmp_path.iterdir()), "nothing is cached from a failed measurement"

    monkeypatch.setenv("DEINFER_MEGATRON_CACHE", str(tmp_path))
    arch, ranks = _model()
    with caplog.at_level(logging.INFO, logger="deinfer_megatron"):
        choice = auto_plan(arch, ranks, Workload(tp=2))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    assert "using the deinfer layout for every block" in warnings[0].getMessage()
    assert choice.plan == choice.plan.uniform(FALLBACK, arch.num_layers) and choice.seconds == []
    assert not list(tmp_path.rglob("*.json")), "nor from the job's own attempt"
    # a job that prices again (a launched rank 0 with its link's rates, every bench cell) is not
    # measured again, nor warned again, within the process
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deinfer_megatron"):
        assert auto_plan(arch, ranks, Workload(tp=2)).plan == choice.plan
    assert not caplog.records


def test_calibration_on_two_ranks() -> None:
    """The real measurement (two local ranks, both tiny sizes, every layout): a complete entry of
    finite, non-negative seconds, below what a whole tiny step could take."""
    got = overhead.measure_overhead(replace(elements_only(), key=TableKey.current(1)), 2)
    assert set(got["blocks"]) == {"deinfer", "naive", "dense"}
    values = [v for per in got["blocks"].values() for v in per.values()] + [got["layer"], got["outside"]]
    assert all(math.isfinite(v) and 0.0 <= v < 1.0 for v in values), got
    assert sum(values) > 0, "a step has framework time"


def test_block_timer_leaves_the_cache_flush_and_the_barrier_out(monkeypatch) -> None:
    """On a clock that only the modules move: the flush (100 s) and the barrier (40 s) before
    every block are in no part, and every part is what its modules spent."""
    import torch

    clock = [0.0]
    monkeypatch.setattr(overhead.time, "perf_counter", lambda: clock[0])

    class Block(torch.nn.Module):
        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.seconds = seconds

        def forward(self, x):
            clock[0] += self.seconds
            return x

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attention, self.mlp = Block(3.0), Block(5.0)

        def forward(self, x):
            clock[0] += 0.5  # the input norm
            x = self.mlp(self.self_attention(x))
            clock[0] += 0.25  # a residual add
            return x

    def flush() -> None:
        clock[0] += 100.0

    def sync() -> None:
        clock[0] += 40.0

    layers = [Layer(), Layer()]
    timer = overhead.BlockTimer(layers, flush=flush, sync=sync)
    for _ in range(2):
        timer.step_mark()
        clock[0] += 7.0  # embedding, sampling
        x = torch.zeros(1)
        for layer in layers:
            x = layer(x)
        clock[0] += 1.0
    timer.step_mark()
    timer.close()
    assert timer.steps == [{"attention": 3.0, "mlp": 5.0, "layer": 0.75, "outside": 8.0}] * 2
    assert timer.medians() == {"attention": 3.0, "mlp": 5.0, "layer": 0.75, "outside": 8.0}


def test_time_stages_interleaves_rounds_and_takes_their_median(monkeypatch) -> None:
    """After one warm-up decode of every stage, ``ROUNDS`` rounds with the order rotated each
    round (so drift does not land on one layout), and each part the median over the rounds."""
    calls: list[str] = []
    seconds = {"a": iter([9.0, 1.0, 3.0, 2.0]), "b": iter([9.0, 5.0, 4.0, 6.0]), "c": iter([9.0, 7.0, 7.0, 8.0])}

    def decode(stage, timer, batch):
        calls.append(stage)
        t = next(seconds[stage])
        return {p: t for p in overhead.PARTS}

    class Stage:
        class model:
            class decoder:
                layers = []

    monkeypatch.setattr(overhead, "_decode", lambda stage, timer, batch: decode(stage.name, timer, batch))
    stages = {}
    for name in "abc":
        stage = Stage()
        stage.name = name
        stages[name] = stage
    got = overhead.time_stages(stages, rounds=3)
    assert calls == list("abc" "bca" "cab" "abc")
    assert got == {"a": dict.fromkeys(overhead.PARTS, 2.0), "b": dict.fromkeys(overhead.PARTS, 5.0),
                   "c": dict.fromkeys(overhead.PARTS, 7.0)}
