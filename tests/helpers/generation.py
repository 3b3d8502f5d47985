"""Generation checks run inside spawned ranks: every layout × KV cache × absorption × driver
(Megatron's static engine, the project's loop, DeepSpeed-Inference) on full-rank folders; and,
on the same ranks, one folder in bfloat16 (``Bf16Case``): greedy tokens, teacher-forced logits,
the caches' dtype and bytes, and ``eval-ppl``'s perplexity, for the test to compare with
Hugging Face transformers run in bfloat16."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Bf16Case:
    """One folder run in bfloat16: ``prompts`` generated greedily for ``max_new`` tokens, the
    logits of ``sequences`` (prompt + reference continuation, teacher-forced), and the
    perplexity of ``text`` in windows of ``window`` tokens (``max_tokens`` in all)."""

    folder: str
    prompts: list[list[int]]
    max_new: int
    sequences: list[list[int]]
    text: str
    window: int
    max_tokens: int


def bf16_checks(tp: int, groups: Any, case: Bf16Case, layouts: list[str]) -> dict[str, Any]:
    """Every layout of ``case.folder`` loaded in bfloat16: greedy tokens of every cache and driver,
    the logits of rank 0 (bfloat16, as computed), each cache's dtype and bytes per token against
    the planner's count in 2-byte elements, and ``eval-ppl``'s body on the same stage."""
    from deinfer_megatron.evaluation.perplexity import PerplexityJob, _perplexity_on_rank
    from deinfer_megatron.generation.context import GenerationContext, describe
    from deinfer_megatron.generation.job import kv_bytes_per_token
    from deinfer_megatron.generation.loop import generate_tokens
    from deinfer_megatron.generation.megatron_engine import generate_with_engine
    from deinfer_megatron.generation.sampling import SamplingParams
    from deinfer_megatron.layers.kv_cache import CacheKind
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.models.pipeline import stage_forward
    from deinfer_megatron.runtime.job import RankContext

    out: dict[str, Any] = {"tokens": {}, "logits": {}, "caches": {}, "ppl": {}, "param_dtypes": set()}
    for layout in layouts:
        stage = load_folder(Path(case.folder), Layout(layout), groups, dtype=torch.bfloat16)
        out["param_dtypes"] |= {str(p.dtype) for p in stage.model.parameters()}
        for kv, absorb, driver in configurations(layout, bool(stage.rank_config.modules)):
            context = GenerationContext(len(case.prompts), max(map(len, case.prompts)) + case.max_new,
                                        kv_cache=kv, absorb_values=absorb)
            run = generate_with_engine if driver == "engine" else generate_tokens
            outs, _ = run(stage, case.prompts, max_new_tokens=case.max_new, params=SamplingParams(), context=context)
            key = f"{layout}/{kv}/{'absorb' if absorb else 'rebuild'}/{driver}"
            out["tokens"][key] = [o.token_ids for o in outs]
            dtypes = {str(t.dtype) for entry in context.key_value_memory_dict.values()
                      for t in ((entry.a, entry.b) if hasattr(entry, "a") else entry)}
            out["caches"][key] = (dtypes, describe(context)["kv_bytes_per_token"],
                                  kv_bytes_per_token(stage, CacheKind.parse(kv)))
        ids = torch.tensor(case.sequences)
        with torch.no_grad():
            logits = stage_forward(stage, ids, torch.arange(ids.shape[1]).expand_as(ids))
        if groups.tp_rank == 0:
            out["logits"][layout] = logits[..., : stage.arch.vocab_size].clone()
        job = PerplexityJob(Path(case.folder), Path(case.text), case.max_tokens, case.window, tp=tp,
                            layout=layout, batch=2, dtype="bfloat16")
        out["ppl"][layout] = _perplexity_on_rank(RankContext(job, stage.layout, stage, groups))
    return out


def generation_worker(tp: int, pp: int, models: dict[str, str], prompts: list[list[int]],
                      max_new: int, layouts: list[str], deepspeed: bool = False,
                      chunked: bool = False, bf16: Bf16Case | None = None) -> dict[str, Any]:
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
        if bf16 is not None:
            results["bf16"] = bf16_checks(tp, groups, bf16, layouts)
    finally:
        shutdown()
    return results
