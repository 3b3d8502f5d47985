"""``--layout auto`` (generate's default) never refuses a job that a fixed layout fits: where the
plan the cost model prefers needs more memory than the machine has, the job gets the fastest
fixed layout that fits (``planning.pricing.within_memory``), priced by the same table; where no
layout fits, nothing is priced and the fallback's memory check says why (``resolve_layout``)."""

from __future__ import annotations

import logging

import pytest

from deinfer_megatron.generation.job import GenerateJob, Generation
from deinfer_megatron.planning import cost_model, preflight
from deinfer_megatron.planning.auto import FALLBACK
from deinfer_megatron.planning.preflight import MemoryBudget
from deinfer_megatron.runtime.job import Prepared
from deinfer_megatron.runtime.options import Parallelism
from deinfer_megatron.specs.layout import Layout, LayoutPlan
from tests.helpers.tiny_models import full_rank_folders

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
NEW = 2000  # a long generation: the KV cache, which naive keeps for every KV head, dominates


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return full_rank_folders(tmp_path_factory.mktemp("auto-memory"), max_position_embeddings=4096)[2]


def test_the_default_takes_the_fastest_layout_that_fits(folder, tmp_path, monkeypatch, caplog) -> None:
    from deinfer_megatron.checkpoints.folder import open_config
    from tests.helpers.cost_tables import favouring

    arch, ranks = open_config(folder, verify=False)
    context = max(map(len, PROMPTS)) + NEW
    table = favouring("naive", arch, ranks, tp=2, batches=(len(PROMPTS),), contexts=(context,))
    cached = cost_model.cache_path(table.key, tmp_path / "cost_model")
    cost_model.save(table, cached)
    before = cached.read_bytes()
    monkeypatch.setenv("DEINFER_MEGATRON_CACHE", str(tmp_path))
    monkeypatch.setattr("torch.get_num_threads", lambda: 1)  # the planted table's key
    job = GenerateJob(folder, ("",), max_new_tokens=NEW, parallel=Parallelism(tp=2, layout="auto"))
    spec = Generation(job, tuple(map(tuple, PROMPTS)))
    prepared = Prepared(spec, arch, ranks, None)

    footprint = spec.footprint(arch)
    assert footprint.kv_tokens == len(PROMPTS) * context and footprint.prefill_rows == len(PROMPTS) * 3
    roomy = MemoryBudget(arch, ranks, 2, 1, 4, footprint, available=1 << 60)
    need = {l: roomy.check(l) for l in (Layout.NAIVE, Layout.DEINFER)}
    assert need[Layout.DEINFER] < need[Layout.NAIVE], "naive caches every KV head on every rank"
    assert prepared.budget.need(Layout.NAIVE)[0] == need[Layout.NAIVE], "the job's own budget counts the same"

    monkeypatch.setattr(preflight, "available_bytes", lambda: 1 << 60)
    free = prepared.choose()
    assert {(b.attention, b.mlp) for b in free.layers} == {(Layout.NAIVE, Layout.NAIVE)}

    monkeypatch.setattr(preflight, "available_bytes", lambda: (need[Layout.DEINFER] + need[Layout.NAIVE]) // 2)
    with caplog.at_level(logging.INFO, logger="deinfer_megatron.planning"):
        tight = prepared.choose()
    # the planted table prices deinfer and dense alike: deinfer comes first among the candidates
    assert {(b.attention, b.mlp) for b in tight.layers} == {(Layout.DEINFER, Layout.DEINFER)}
    assert prepared.budget.fits(tight)
    assert "does not fit in memory; using deinfer" in caplog.text

    monkeypatch.setattr(preflight, "available_bytes", lambda: need[Layout.DEINFER] // 4)
    monkeypatch.setattr("deinfer_megatron.planning.auto.auto_plan", lambda *a, **k: pytest.fail("priced"))
    nothing = prepared.choose()  # nothing fits: the fallback, unpriced, whose check says why
    assert nothing == LayoutPlan.uniform(FALLBACK, arch.num_layers)
    with pytest.raises(ValueError, match="GiB is available"):
        prepared.check(nothing)
    assert cached.read_bytes() == before, "priced from the planted table alone: nothing measured"
