"""A bench whose ranks cross a link (``BenchGrid.collectives``: the two-namespace bench measures
it) prices ``auto`` and ``--predict`` with the link's rates, not the host table's local ones:
the plan follows the link (fewest parameters when collectives are free, fewest collective
elements when bytes cost), and the predicted collectives are the link's latency per collective."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.bench import matrix, prediction
from deinfer_megatron.bench.records import Cell
from deinfer_megatron.bench.sources import ModelSource
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.planning import auto
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.planning.request import AUTO
from deinfer_megatron.specs.layout import Layout, LayoutPlan
from deinfer_megatron.specs.rank_config import RankConfig
from tests.helpers.cost_tables import FREE, params_only
from tests.planning.test_auto import ATTN, CFG, MLP, _ranks, expected_by_elements, expected_by_params

SLOW_LINK = {"all_reduce": [0.0, 1e6], "all_gather": [0.0, 1e6]}  # 1 MB/s: bytes decide
LATENCY = 1e-3


@pytest.fixture
def source(monkeypatch, tmp_path) -> ModelSource:
    """The tiny model of test_auto (layers that choose differently), priced by ``params_only``
    as the host table: only weights cost time there, collectives are free. Its folders are never
    read: a cell is prepared from the source's own architecture and ranks."""
    monkeypatch.setattr(auto, "table_for", lambda *a, **k: params_only())
    arch = arch_from_hf_config(CFG)
    return ModelSource("tiny", arch, RankConfig.from_mapping(_ranks(), arch), tmp_path, tmp_path)


def _prepared(cell: Cell, source: ModelSource, collectives=None):
    grid = matrix.BenchGrid(synthetic="llama-tiny", gen_len=16, collectives=collectives)
    return matrix.prepare_cell(cell, source, grid)


def _plan(layout) -> list[tuple[str, str]]:
    assert isinstance(layout, LayoutPlan)
    return [(b.attention.value, b.mlp.value) for b in layout.layers]


def test_auto_cells_follow_the_links_rates(source) -> None:
    cell = Cell(AUTO, CacheKind.FULL, 2, 8, 48)  # context 48 + 16 = 64, as test_auto prices
    n = source.arch.num_layers
    local = _prepared(cell, source).plan
    assert _plan(local) == [(expected_by_params(i, ATTN, 2), expected_by_params(i, MLP, 2)) for i in range(n)]
    linked_cell = _prepared(cell, source, SLOW_LINK)
    linked = linked_cell.plan
    assert _plan(linked) == [(expected_by_elements(i, ATTN, 2), expected_by_elements(i, MLP, 2)) for i in range(n)]
    assert _plan(linked) != _plan(local)
    # the planner's totals are those of the plan the cell runs
    totals = matrix.plan_totals(linked_cell)
    assert totals.elements_per_token == make_plan(source.arch, source.rank_config, linked, tp=2,
                                                  batch=8).totals["elements_per_token"]


@pytest.mark.parametrize("layout", [Layout.DEINFER, Layout.NAIVE])
def test_predicted_collectives_are_the_links_latency_per_collective(source, layout) -> None:
    cell = Cell(layout, CacheKind.FULL, 2, 8, 48)
    rec = SimpleNamespace(cell=cell, gen_len=16, summary=SimpleNamespace(tpot_s=0.01))
    link = {"all_reduce": [LATENCY, FREE], "all_gather": [LATENCY, FREE]}
    local = prediction.predict(rec, source, params_only())
    linked = prediction.predict(rec, source, params_only(), collectives=link)
    assert local.parts["collectives_s"] == pytest.approx(0.0, abs=1e-12)
    # every collective of a step (the plan's, and Megatron's two of the vocabulary) pays the latency
    count = matrix.plan_totals(_prepared(cell, source)).collectives_per_token + 2
    assert linked.parts["collectives_s"] == pytest.approx(count * LATENCY, rel=1e-6)
    assert linked.parts["weights_kv_s"] == pytest.approx(local.parts["weights_kv_s"], rel=1e-9)
    assert linked.predicted_s == pytest.approx(local.predicted_s + count * LATENCY, rel=1e-6)
