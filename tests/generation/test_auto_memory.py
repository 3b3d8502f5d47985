"""``--layout auto`` (generate's default) never refuses a job that a fixed layout fits: where the
plan the cost model prefers needs more memory than the machine has, the job gets the fastest
fixed layout that fits (``planning.auto.within_memory``), priced by the same table."""

from __future__ import annotations

import logging

import pytest

from deinfer_megatron.generation.job import GenerateJob, auto_plan_for, memory_sizes
from deinfer_megatron.generation.options import Parallelism
from deinfer_megatron.planning import cost_model, preflight
from deinfer_megatron.specs.layout import Layout
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

    sizes = dict(tp=2, pp=1, dtype_bytes=4, **memory_sizes(job, PROMPTS), available=1 << 60)
    assert sizes["kv_tokens"] == len(PROMPTS) * context and sizes["prefill_rows"] == len(PROMPTS) * 3
    need = {l: preflight.check_fits(arch, ranks, l, **sizes) for l in ("naive", "deinfer")}
    assert need["deinfer"] < need["naive"], "naive caches every KV head on every rank"

    free = auto_plan_for(job, PROMPTS)
    assert {(b.attention, b.mlp) for b in free.layers} == {(Layout.NAIVE, Layout.NAIVE)}

    monkeypatch.setattr(preflight, "available_bytes", lambda: (need["deinfer"] + need["naive"]) // 2)
    with caplog.at_level(logging.INFO, logger="deinfer_megatron.planning.auto"):
        tight = auto_plan_for(job, PROMPTS)
    # the planted table prices deinfer and dense alike: deinfer comes first among the candidates
    assert {(b.attention, b.mlp) for b in tight.layers} == {(Layout.DEINFER, Layout.DEINFER)}
    assert preflight.fits(arch, ranks, tight, **{**sizes, "available": None})
    assert "does not fit in memory; using deinfer" in caplog.text

    monkeypatch.setattr(preflight, "available_bytes", lambda: need["deinfer"] // 4)
    nothing = auto_plan_for(job, PROMPTS)  # nothing fits: the preferred plan, whose check says why
    assert nothing == free
    with pytest.raises(ValueError, match="GiB is available"):
        preflight.check_fits(arch, ranks, nothing, **{**sizes, "available": None})
    assert cached.read_bytes() == before, "priced from the planted table alone: nothing measured"
