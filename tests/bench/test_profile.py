"""``bench --profile --predict`` through the CLI at llama-tiny, TP 2: every rank's decode step is
split into parts that are non-negative, fit in the step and agree with the raw collective
timestamps recomputed here; the ranks agree on the step; and each cell's predicted step is the
cost model's for the planted table, computed here independently of the bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deinfer_megatron.decompose.allocation import uniform_ranks
from deinfer_megatron.models.synthetic import synthetic_arch
from deinfer_megatron.planning import cost_model
from deinfer_megatron.planning.pricing import Workload, choose_layouts
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig
from tests.helpers.cost_tables import latency_only, with_free_shapes

CLI = [sys.executable, "-m", "deinfer_megatron.cli.main", "bench"]
PARTS = ("gemm_s", "collective_wait_s", "collective_s", "other_s")
OVERHEAD = {"2": {"blocks": {"deinfer": {"attention": 4e-4, "mlp": 3e-4}, "naive": {"attention": 5e-4, "mlp": 4e-4},
                             "dense": {"attention": 4e-4, "mlp": 2e-4}}, "layer": 1e-4, "outside": 2e-3}}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[dict, str, cost_model.CostTable]:
    tmp = tmp_path_factory.mktemp("profile")
    planted = latency_only(2e-5, OVERHEAD)
    key = cost_model.TableKey.current(1)
    table = cost_model.CostTable(key, planted.gemm, planted.memory_bytes_per_s, planted.collectives, planted.overhead)
    arch = synthetic_arch("llama-tiny")  # matrix products free, as the planted grid prices them
    table = with_free_shapes(table, arch, RankConfig.from_mapping(uniform_ranks(arch, 0.6), arch), tp=2, batches=(2,),
                             contexts=(128 + 3,))  # the default --prompt-len and this run's --gen-len
    cost_model.save(table, cost_model.cache_path(key, tmp / "cache" / "cost_model"))
    proc = subprocess.run([*CLI, "--synthetic", "llama-tiny", "--tp", "2", "--batch", "2", "--gen-len", "3",
                           "--repeats", "1", "--layouts", "naive,deinfer", "--profile", "--predict",
                           "--json", "out.json", "--markdown", "out.md", "--no-progress"],
                          capture_output=True, text=True, timeout=600, cwd=tmp,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "DEINFER_MEGATRON_CACHE": str(tmp / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text()), (tmp / "out.md").read_text(), table


def test_every_rank_step_splits_into_consistent_parts(profiled) -> None:
    doc, md, _ = profiled
    assert doc["args"]["profile"] is True and doc["counts"]["ok"] == 2
    for cell in doc["cells"]:
        where = cell["layout"]
        parts = cell["step_profile"]
        assert [p["tp_rank"] for p in parts] == [0, 1], where
        for p, rank in zip(parts, cell["ranks"]):
            raw = rank["profile"]
            assert p["step_s"] == pytest.approx(raw["step_end"] - raw["step_start"]), where
            assert all(p[k] >= 0 for k in PARTS) and p["gemm_s"] > 0, (where, p)
            assert sum(p[k] for k in PARTS) == pytest.approx(p["step_s"], rel=1e-9), where
            # the project's collectives of one decode step, as the ledger counted them
            assert p["collectives"] == cell["summary"]["collectives_per_token"] == len(raw["spans"]), where
            # waiting + own cost is each collective's whole time inside it, from the raw timestamps
            inside = sum(left - entered for _, entered, left in raw["spans"])
            assert p["collective_wait_s"] + p["collective_s"] == pytest.approx(inside, abs=1e-5), where
        # the ranks leave one barrier together and meet in every collective: their steps agree
        steps = [p["step_s"] for p in parts]
        assert abs(steps[0] - steps[1]) <= 0.5 * max(steps), (where, steps)
        # the k-th collective's last arrival waits for nobody
        spans = [r["profile"]["spans"] for r in cell["ranks"]]
        for k in range(len(spans[0])):
            assert spans[0][k][0] == spans[1][k][0], "both ranks issue the same collectives in order"
    assert "## Where a decode step goes" in md and md.count("| deinfer | 2 | 2 | 128 |") == 2


def test_predicted_step_is_the_cost_models(profiled) -> None:
    doc, md, table = profiled
    arch = synthetic_arch("llama-tiny")
    ranks = RankConfig.from_mapping(uniform_ranks(arch, 0.6), arch)
    choice = choose_layouts(arch, ranks, Workload(tp=2, batch=2, context=128 + 3), table)
    for cell in doc["cells"]:
        p = cell["prediction"]
        assert p["chosen"] == cell["layout"]
        assert p["predicted_s"] == pytest.approx(choice.fixed_step_seconds(Layout(cell["layout"])), rel=1e-9)
        assert p["measured_s"] == cell["summary"]["tpot_s"]
        assert p["predicted_over_measured"] == pytest.approx(p["predicted_s"] / p["measured_s"])
        # the parts, by arithmetic: every collective's latency (the planted bandwidth is free),
        # the layer's and Megatron's two vocabulary ones; the fixed times of 4 layers and outside
        parts, fixed = p["parts"], OVERHEAD["2"]["blocks"][cell["layout"]]
        assert sum(parts.values()) == pytest.approx(p["predicted_s"], rel=1e-9)
        coll = (cell["summary"]["collectives_per_token"] + 2) * 2e-5
        assert parts["collectives_s"] == pytest.approx(coll, rel=1e-6)
        want_fixed = 4 * (fixed["attention"] + fixed["mlp"] + OVERHEAD["2"]["layer"]) + OVERHEAD["2"]["outside"]
        assert parts["fixed_s"] == pytest.approx(want_fixed, rel=1e-9) and parts["weights_kv_s"] > 0
    assert "## Predicted against measured decode step" in md
