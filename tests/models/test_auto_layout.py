"""A model built from a ``--layout auto`` plan — a different layout per block, dense blocks
multiplied out next to factored ones — has the classes the plan names in every block and
gives the logits of the multiplied-out Hugging Face reference and of every fixed layout
(real gloo ranks, TP=2, one launch)."""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.distributed import run_ranks

TOL = 1e-4


def _block_classes(stage: Any) -> list[dict[str, str]]:
    out = []
    for layer in stage.model.decoder.layers:
        attn = layer.self_attention
        qkv = getattr(attn, "linear_qkv_down", None) or attn.linear_qkv
        out.append({"attention": type(qkv).__name__, "proj": type(attn.linear_proj).__name__,
                    "fc1": type(layer.mlp.linear_fc1).__name__, "fc2": type(layer.mlp.linear_fc2).__name__})
    return out


def auto_worker() -> dict[str, Any]:
    from deinfer_megatron.arch.model import arch_from_hf_config
    import torch.distributed as dist

    from deinfer_megatron.models.build import build_stage, load_weights
    from deinfer_megatron.models.pipeline import stage_forward
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.planning.pricing import Workload, choose_layouts
    from deinfer_megatron.runtime.agree import agreed_plan, plan_on_rank0
    from deinfer_megatron.specs.layout import Layout, LayoutPlan
    from deinfer_megatron.specs.rank_config import RankConfig
    from tests.helpers.cost_tables import elements_only, params_only
    from tests.helpers.tiny_models import decompose_randomly, random_hf_model
    from tests.planning.test_auto import _ranks

    groups = init_parallel(2, 1)
    out: dict[str, Any] = {"results": {}}
    try:
        hf = random_hf_model("llama")
        names = _ranks()
        state = decompose_randomly(hf, names)
        arch = arch_from_hf_config(hf.config.to_dict())
        ranks = RankConfig.from_mapping(names, arch)
        ids = torch.randint(0, arch.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
        pos = torch.arange(11).unsqueeze(0).expand(2, -1)
        with torch.no_grad():
            ref = hf(ids).logits
        work = Workload(tp=2, batch=2, context=11)
        layouts: dict[str, Any] = {l.value: l for l in Layout}
        for name, table in (("auto-params", params_only), ("auto-elements", elements_only)):
            layouts[name] = choose_layouts(arch, ranks, work, table()).plan
        logits = {}
        for name, layout in layouts.items():
            stage = build_stage(arch, ranks, layout, groups)
            load_weights(stage, state, ranks)
            logits[name] = stage_forward(stage, ids, pos)
            out["results"][name] = {
                "plan": layout.to_json() if isinstance(layout, LayoutPlan) else None,
                "classes": _block_classes(stage),
                "max_abs_diff": (logits[name] - ref).abs().max().item(),
                "greedy_equal": bool((logits[name].argmax(-1) == ref.argmax(-1)).all()),
            }
        for name in ("auto-params", "auto-elements"):
            out["results"][name]["vs_fixed"] = {
                l.value: (logits[name] - logits[l.value]).abs().max().item() for l in Layout}
        out["logit_scale"] = ref.abs().max().item()
        # each rank has a plan of its own; every rank builds global rank 0's (one broadcast)
        own = LayoutPlan.uniform(Layout.NAIVE if groups.tp_rank else Layout.DEINFER, arch.num_layers)
        out["agreed"] = agreed_plan(plan_on_rank0(lambda: own, dist.get_rank()), groups.device).to_json()
    finally:
        shutdown()
    return out


def test_auto_plans_build_their_classes_and_match_every_fixed_layout() -> None:
    from deinfer_megatron.specs.layout import FACTOR_CLASSES, Layout

    per_rank = run_ranks(2, auto_worker)
    dense = {"attention": "CountedColumnParallelLinear", "proj": "CountedRowParallelLinear",
             "fc1": "CountedColumnParallelLinear", "fc2": "CountedRowParallelLinear"}
    chosen = set()
    for rank in per_rank:
        scale = max(1.0, rank["logit_scale"])
        for name, entry in rank["results"].items():
            assert entry["max_abs_diff"] <= TOL * scale and entry["greedy_equal"], name
            if entry["plan"] is None:
                continue
            for layer, (blocks, classes) in enumerate(zip(entry["plan"], entry["classes"])):
                chosen.update(blocks.values())
                attn, mlp = FACTOR_CLASSES[Layout(blocks["attention"])], FACTOR_CLASSES[Layout(blocks["mlp"])]
                want = {
                    "attention": attn.qkv_down.__name__ if attn else dense["attention"],
                    "proj": attn.row.__name__ if attn else dense["proj"],
                    "fc1": mlp.column.__name__ if mlp else dense["fc1"],
                    "fc2": mlp.row.__name__ if mlp else dense["fc2"],
                }
                assert classes == want, (name, layer)
            assert max(entry["vs_fixed"].values()) <= 2 * TOL * scale, name
    assert chosen == {"deinfer", "naive", "dense"}, "the two plans use every layout somewhere"
    assert per_rank[0]["agreed"] == per_rank[1]["agreed"]
    assert {b["attention"] for b in per_rank[1]["agreed"]} == {"deinfer"}
