"""``--layout auto`` chooses per block what the cost model says, and the per-host cache is
trusted only for the host, version, torch and thread count that measured it."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.planning import host
from deinfer_megatron.planning.pricing import Workload, choose_layouts
from deinfer_megatron.planning.cost_model import TableKey, cache_path, load_cached, save
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig
from tests.helpers.cost_tables import elements_only, fake_measure_shapes, params_only, zero_overhead
from tests.helpers.tiny_models import TINY_CONFIGS

CFG = TINY_CONFIGS["llama"]
H, I = CFG["hidden_size"], CFG["intermediate_size"]
KV = CFG["num_key_value_heads"] * H // CFG["num_attention_heads"]
LOW = 8  # every module of layer 0
# layer 2: ranks close to full (a factor pair larger than its dense matrix); layers 1, 3 dense
HIGH = {"q_proj": 60, "k_proj": 30, "v_proj": 30, "o_proj": 60, "gate_proj": 60, "up_proj": 60, "down_proj": 60}
SHAPES = {"q_proj": (H, H), "k_proj": (KV, H), "v_proj": (KV, H), "o_proj": (H, H),
          "gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


def _ranks() -> dict[str, int]:
    out = {}
    for p in ATTN + MLP:
        part = "self_attn" if p in ATTN else "mlp"
        out[f"model.layers.0.{part}.{p}"] = LOW
        out[f"model.layers.2.{part}.{p}"] = HIGH[p]
    return out


def _layer_ranks(layer: int) -> dict[str, int] | None:
    return {p: LOW for p in ATTN + MLP} if layer == 0 else HIGH if layer == 2 else None


def _padded(n: int, tp: int) -> int:
    return -(-n // tp) * tp


def expected_by_params(layer: int, block: tuple[str, ...], tp: int) -> str:
    """Fewest parameters per rank: naive splits every factor (r·(in+out)/t per pair), dense
    splits W (out·in/t); DeInfer replicates U_o / U_down, so it never has the fewest."""
    ranks = _layer_ranks(layer)
    if ranks is None:
        return "dense"
    naive = sum(ranks[p] * sum(SHAPES[p]) for p in block) / tp
    dense = sum(SHAPES[p][0] * SHAPES[p][1] for p in block) / tp
    return "naive" if naive < dense else "dense"


def expected_by_elements(layer: int, block: tuple[str, ...], tp: int) -> str:
    """Fewest collective elements per token (DESIGN.md §3): dense sends h per block, DeInfer
    the gathered latents and the reduced r_o / r_down, naive every pair's full output."""
    ranks = _layer_ranks(layer)
    if ranks is None:
        return "dense"
    if block == ATTN:
        sizes = {"deinfer": _padded(ranks["q_proj"] + ranks["k_proj"] + ranks["v_proj"], tp) + ranks["o_proj"],
                 "naive": 2 * H + 2 * KV, "dense": H}
    else:
        sizes = {"deinfer": _padded(ranks["gate_proj"] + ranks["up_proj"], tp) + ranks["down_proj"],
                 "naive": 2 * I + H, "dense": H}
    return min(sizes, key=sizes.get)


@pytest.mark.parametrize("table,expected", [(params_only, expected_by_params), (elements_only, expected_by_elements)],
                         ids=["params", "elements"])
def test_auto_takes_the_cheapest_layout_of_every_block(table, expected) -> None:
    arch = arch_from_hf_config(CFG)
    ranks = RankConfig.from_mapping(_ranks(), arch)
    choice = choose_layouts(arch, ranks, Workload(tp=2, batch=8, context=64), table())
    got = [(b.attention.value, b.mlp.value) for b in choice.plan.layers]
    want = [(expected(i, ATTN, 2), expected(i, MLP, 2)) for i in range(arch.num_layers)]
    assert got == want
    assert len({x for pair in got[::2] for x in pair}) == 2, "the decomposed layers choose differently"
    # the chosen plan is predicted no slower than any fixed layout, and faster than each here
    for layout in Layout:
        assert choice.step_seconds < choice.fixed_step_seconds(layout), layout


def test_latent_cache_keeps_every_decomposed_attention_in_deinfer() -> None:
    """Without the latent cache, params-only picks naive (layer 0) and dense (layer 2) for
    attention; ``--kv-cache latent`` asks for whole latents, which only DeInfer keeps."""
    arch = arch_from_hf_config(CFG)
    ranks = RankConfig.from_mapping(_ranks(), arch)
    choice = choose_layouts(arch, ranks, Workload(tp=2, batch=8, context=64, latent_cache=True), params_only())
    assert [b.attention.value for b in choice.plan.layers] == ["deinfer", "dense", "deinfer", "dense"]
    assert [b.mlp.value for b in choice.plan.layers] == [expected_by_params(i, MLP, 2) for i in range(4)]
    assert choice.plan.supports_latent_cache


def test_a_dense_model_has_nothing_to_choose(monkeypatch) -> None:
    """``auto`` (the default of ``generate``) on a model without decomposed blocks: dense
    throughout, without reading or measuring a cost table."""
    from deinfer_megatron.planning.auto import auto_plan

    def never(*args, **kwargs):
        raise AssertionError("a dense model needs no cost table")

    monkeypatch.setattr("deinfer_megatron.planning.auto.table_for", never)
    arch = arch_from_hf_config(CFG)
    choice = auto_plan(arch, RankConfig.dense(arch), Workload(tp=2))
    assert choice.plan.name == "dense" and len(choice.plan.layers) == arch.num_layers
    assert all(b.attention is Layout.DENSE and b.mlp is Layout.DENSE for b in choice.plan.layers)


def test_cache_of_another_host_or_version_is_ignored(tmp_path, monkeypatch, caplog) -> None:
    key = TableKey.current(1)
    table = replace(params_only(), key=key)
    path = cache_path(key, tmp_path)
    save(table, path)
    assert load_cached(path, key) == table
    for other in (replace(key, host="elsewhere"), replace(key, version="0.0.1"), replace(key, torch="1.0"),
                  replace(key, threads=7), replace(key, format=key.format - 1),
                  replace(key, allocator="system")):  # timed with large blocks mapped afresh
        foreign = replace(table, key=other)
        path.write_text(json.dumps(foreign.to_json()))
        assert load_cached(path, key) is None, other
    path.write_text("{not json")
    assert load_cached(path, key) is None
    # each allocator state has its own file: switching DEINFER_MEGATRON_MALLOC does not re-measure the other's
    from deinfer_megatron.launch.allocator import DEFAULT_STATE

    default_path = cache_path(replace(key, allocator=DEFAULT_STATE), tmp_path)
    assert default_path.name == f"{cache_path(replace(key, allocator=''), tmp_path).stem}.json"
    assert cache_path(replace(key, allocator="system"), tmp_path).name == default_path.stem + "-system.json"
    assert cache_path(replace(key, allocator="preloaded jemalloc"), tmp_path).name == \
        default_path.stem + "-preloaded_jemalloc.json"
    # host_table measures again (here: a stand-in calibration) and replaces the foreign cache
    calls = []

    def fake_calibrate(k, *, collectives):
        calls.append((k, collectives))
        return replace(table, key=k)

    monkeypatch.setattr("deinfer_megatron.planning.calibrate.calibrate", fake_calibrate)
    monkeypatch.setattr("deinfer_megatron.planning.calibrate.measure_shapes", fake_measure_shapes)
    monkeypatch.setattr("deinfer_megatron.planning.overhead.measure_overhead",
                        lambda t, tp: zero_overhead(tp)[str(tp)])
    path.write_text(json.dumps(replace(table, key=replace(key, host="elsewhere")).to_json()))
    with caplog.at_level(logging.INFO, logger="deinfer_megatron.planning"):
        assert host.host_table(tp=2, threads=1, root=tmp_path).key == key
    assert calls == [(key, True)]
    said = [r.getMessage() for r in caplog.records if "measuring this machine's cost table once" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0] and "framework time at TP=2" in said[0], said
    assert load_cached(path, key).key == key
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deinfer_megatron.planning"):
        host.host_table(tp=2, threads=1, root=tmp_path)  # now cached: not measured again
    assert len(calls) == 1 and not caplog.records


def test_a_dense_mlp_that_tp_cannot_split_is_never_chosen() -> None:
    """Megatron's dense MLP splits the intermediate size evenly (SmolLM2's 1536 at TP 9 does not):
    at such a TP size auto keeps every decomposed MLP in a layout that splits its ranks, even where
    dense would be priced cheapest, and the fixed dense layout is refused in one line naming the
    sizes, by the planner as by the spec builder."""
    from deinfer_megatron.arch.model import transformer_config
    from deinfer_megatron.planning.plan import layer_plan
    from deinfer_megatron.specs.builder import layer_spec
    from tests.helpers.cost_tables import favouring

    arch = arch_from_hf_config({**CFG, "intermediate_size": 90})  # 90 = 2 · 45: TP 4 does not split it
    full = {f"model.layers.{i}.{part}.{p}": min(s)
            for i in range(arch.num_layers) for part, names in (("self_attn", ATTN), ("mlp", MLP))
            for p, s in ((p, {**SHAPES, "gate_proj": (90, H), "up_proj": (90, H), "down_proj": (H, 90)}[p]) for p in names)}
    ranks = RankConfig.from_mapping(full, arch)
    work = Workload(tp=4, batch=1, context=16)
    table = favouring("dense", arch, ranks, tp=4, batches=(1,), contexts=(16,))
    choice = choose_layouts(arch, ranks, work, table)
    assert [b.attention.value for b in choice.plan.layers] == ["dense"] * arch.num_layers, "dense where it splits"
    assert "dense" not in {b.mlp.value for b in choice.plan.layers}
    assert all("dense" not in layer["mlp"] for layer in choice.seconds)
    assert "dense" in choose_layouts(arch, ranks, replace(work, tp=2), table).seconds[0]["mlp"], "90 splits at TP 2"
    want = "layer 0: a dense MLP needs --tp to divide its intermediate size (90), not 4"
    with pytest.raises(ValueError, match=want.replace("(", r"\(").replace(")", r"\)")):
        layer_plan(arch, ranks, Layout.DENSE, 4, 0, 4)
    with pytest.raises(ValueError, match=r"intermediate size \(90\), not 4"):
        layer_spec(transformer_config(arch, tp=4, pp=1), ranks.layers[0], Layout.DENSE, 0)
