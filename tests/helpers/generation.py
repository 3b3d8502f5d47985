"""Generation checks run inside spawned ranks: every layout × KV cache × absorption × driver
(Megatron's static engine, the project's loop, DeepSpeed-Inference) on full-rank folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deinfer_megatron.specs.layout import Layout

CHUNKED = "-chunked"  # a driver run with a prefill of one position per forward


def configurations(layout: str, decomposed: bool, chunked: bool = False) -> list[tuple[str, bool, str]]:
    """(kv cache, absorb values, driver) combinations that apply to a layout; with ``chunked``,
    also drivers whose prefill goes one position at a time (``generation.prefill``)."""
    combos = [("full", True, "engine"), ("full", True, "loop")]
    if decomposed and layout == "deinfer":
        combos += [("latent", True, "engine"), ("latent", True, "loop"), ("latent", False, "loop")]
    if chunked:
        combos += [(kv, absorb, driver + CHUNKED) for kv, absorb, driver in combos
                   if (kv, absorb, driver) != ("latent", True, "loop")]  # the engine covers that one
    return combos


def generation_worker(tp: int, pp: int, models: dict[str, str], prompts: list[list[int]],
                      max_new: int, layouts: list[str], deepspeed: bool = False,
                      chunked: bool = False) -> dict[str, Any]:
    from deinfer_megatron.generation.context import GenerationContext
    from deinfer_megatron.generation.loop import generate_tokens
    from deinfer_megatron.generation.megatron_engine import generate_with_engine
    from deinfer_megatron.generation.sampling import SamplingParams
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown

    groups = init_parallel(tp, pp)
    results: dict[str, Any] = {}
    try:
        for name, folder in models.items():
            for layout in layouts:
                stage = load_folder(Path(folder), Layout(layout), groups)
                decomposed = bool(stage.rank_config.modules)
                for kv, absorb, driver in configurations(layout, decomposed, chunked):
                    context = GenerationContext(len(prompts), max(map(len, prompts)) + max_new,
                                                kv_cache=kv, absorb_values=absorb)
                    run = generate_with_engine if driver.startswith("engine") else generate_tokens
                    chunked = {"max_prefill_tokens": len(prompts)} if driver.endswith(CHUNKED) else {}
                    outs, _ = run(stage, prompts, max_new_tokens=max_new, params=SamplingParams(),
                                  context=context, **chunked)
                    key = f"{name}/{layout}/{kv}/{'absorb' if absorb else 'rebuild'}/{driver}"
                    results[key] = [o.token_ids for o in outs]
                    if layout == "deinfer" and kv == "full" and driver == "loop":
                        single = []  # the same prompts one at a time
                        for p in prompts:
                            ctx = GenerationContext(1, len(p) + max_new)
                            single.append(generate_tokens(stage, [p], max_new_tokens=max_new,
                                                          params=SamplingParams(), context=ctx)[0][0].token_ids)
                        results[f"{name}/one-at-a-time"] = single
                if layout == "deinfer":  # sampling: identical draws on every rank, both drivers
                    sampled = SamplingParams(greedy=False, temperature=0.8, top_p=0.9, seed=3)
                    for driver, run in (("engine", generate_with_engine), ("loop", generate_tokens)):
                        ctx = GenerationContext(len(prompts), max(map(len, prompts)) + max_new)
                        outs, _ = run(stage, prompts, max_new_tokens=max_new, params=sampled, context=ctx)
                        results[f"{name}/sampled/{driver}"] = [o.token_ids for o in outs]
                if deepspeed and layout == "deinfer":
                    from deinfer_megatron.runtime.engines import driven_by
                    from deinfer_megatron.runtime.options import Engine

                    wrapped = driven_by(Engine.DEEPSPEED, stage, torch.float32)
                    for driver, run in (("engine", generate_with_engine), ("loop", generate_tokens)):
                        ctx = GenerationContext(len(prompts), max(map(len, prompts)) + max_new)
                        outs, _ = run(wrapped, prompts, max_new_tokens=max_new, params=SamplingParams(), context=ctx)
                        results[f"{name}/deepspeed/{driver}"] = [o.token_ids for o in outs]
    finally:
        shutdown()
    return results
