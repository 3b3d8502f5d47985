"""``--layout auto`` under a launcher: every rank builds global rank 0's plan.

Each rank of a torchrun job gets its own cache folder with a planted cost table that favours
another layout (only the layouts' fixed framework time costs anything, and each table makes a
different layout free). Were every rank to resolve ``auto`` itself they would build different
blocks (and rank 1, whose table lacks a shape, would measure it beside its peer); the job must
price one plan, on rank 0, build it on both ranks and give the fixed layouts' tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from tests.helpers.cost_tables import favouring
from tests.helpers.tiny_models import full_rank_folders, hf_greedy_texts

PROMPTS = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever"]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict:
    from deinfer_megatron.checkpoints.folder import open_config
    from deinfer_megatron.planning import cost_model
    from deinfer_megatron.planning.pricing import Workload, choose_layouts

    root = tmp_path_factory.mktemp("auto-agree")
    hf, _, dec = full_rank_folders(root, max_position_embeddings=4096)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(dec)
    expected = hf_greedy_texts(hf, dec, PROMPTS, NEW_TOKENS)
    arch, ranks = open_config(dec, verify=False)
    context = max(len(tok(p)["input_ids"]) for p in PROMPTS) + NEW_TOKENS
    plans, files = [], []
    for rank, layout in enumerate(("naive", "deinfer")):
        table = favouring(layout, arch, ranks, tp=2, batches=(len(PROMPTS),), contexts=(context,))
        work = Workload(tp=2, batch=len(PROMPTS), context=context)
        plans.append(choose_layouts(arch, ranks, work, table).plan.to_json())
        if rank == 1:  # one shape short: a rank pricing its own plan would measure it and rewrite the file
            table = replace(table, shapes=dict(sorted(table.shapes.items())[1:]))
        files.append(cost_model.cache_path(table.key, root / f"cache{rank}" / "cost_model"))
        cost_model.save(table, files[-1])
    assert plans[0] != plans[1], "the planted tables must make the ranks disagree"
    return {"root": root, "dec": dec, "expected": expected, "plans": plans, "files": files}


def test_launched_ranks_build_rank0s_plan(planted) -> None:
    root, dec = planted["root"], planted["dec"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--no-python",
           "sh", "-c", f'DEINFER_MEGATRON_CACHE="{root}/cache$LOCAL_RANK" exec "$@"', "sh",
           sys.executable, "-m", "deinfer_megatron.cli.main", "generate", "--model", str(dec),
           "--max-new-tokens", str(NEW_TOKENS), "--tp", "2", "--layout", "auto", "--json"]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    before = planted["files"][1].read_bytes()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=root,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert doc["layout"] == "auto" and doc["block_layouts"] == planted["plans"][0], doc.get("block_layouts")
    assert [o["token_ids"] for o in doc["outputs"]] == planted["expected"]
    # rank 1 priced no plan of its own: its (incomplete) table was neither completed nor rewritten
    assert planted["files"][1].read_bytes() == before


def test_rank0s_error_reaches_every_rank(monkeypatch) -> None:
    """A plan rank 0 cannot price ends every rank with its message (one rank here)."""
    import torch.distributed as dist

    from deinfer_megatron.launch.local import free_port, local_rank_env
    from deinfer_megatron.runtime.agree import agreed_plan, plan_on_rank0
    from deinfer_megatron.specs.layout import Layout, LayoutPlan

    for k, v in local_rank_env(0, 1, free_port()).items():
        monkeypatch.setenv(k, v)

    def fails() -> LayoutPlan:
        raise ValueError("no table here")

    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        plan = LayoutPlan.uniform(Layout.NAIVE, 2)
        assert agreed_plan(plan_on_rank0(lambda: plan, 0), torch.device("cpu")) == plan
        with pytest.raises(RuntimeError, match="rank 0 could not choose a plan: no table here"):
            agreed_plan(plan_on_rank0(fails, 0), torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_serve_refuses_auto_in_one_line(tmp_path) -> None:
    """``serve`` keeps one layout for every batch its scheduler forms: a job built in Python with
    ``auto`` is refused before anything is read (its CLI offers the fixed layouts only)."""
    pytest.importorskip("fastapi")
    from deinfer_megatron.runtime.options import Parallelism
    from deinfer_megatron.serving.server import ServeJob, validate

    with pytest.raises(ValueError, match="serve takes a fixed --layout"):
        validate(ServeJob(model=tmp_path, parallel=Parallelism(tp=1, layout="auto")))
