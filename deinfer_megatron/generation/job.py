"""The ``generate`` job: text prompts in, generated text out, on TP×PP ranks.

Prompts are tokenised (and checked) before any rank starts, so bad input fails in a second.
Each rank loads its stage, sizes the KV cache (one slot per prompt; tokens per slot from the
request or from ``--kv-budget-gb``), optionally wraps the stage in DeepSpeed-Inference, and
generates with Megatron's static engine — or the project's loop for what that engine cannot
carry. Global rank 0 streams a single prompt's text as it is generated and returns the result.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from deinfer_megatron.generation.options import (
    CacheOptions,
    DType,
    Engine,
    Parallelism,
    latent_cache_layouts,
)
from deinfer_megatron.generation.prefill import DEFAULT_MAX_PREFILL_TOKENS, check_max_tokens, largest_forward_rows
from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.specs.layout import AUTO
from deinfer_megatron.parallel import comm
from deinfer_megatron.planning.agree import needs_agreement, plan_in_job, plan_on_rank0
from deinfer_megatron.launch.run import run_on_ranks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateJob:
    """One ``generate`` request: the prompts and how to continue them, where the ranks run and
    what they cache, who drives the steps.

    ``engine`` and ``dtype`` are parsed on construction (``Engine.parse``, ``DType.parse``; a
    member passes unchanged), like the layout and cache kind of ``parallel`` and ``cache``, so
    a job built in Python may name them.
    """

    model: Path
    prompts: tuple[str, ...]
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    chat: bool = False
    parallel: Parallelism = field(default_factory=Parallelism)
    cache: CacheOptions = field(default_factory=CacheOptions)
    engine: Engine = Engine.MEGATRON
    own_loop: bool = False  # the project's loop even where Megatron's engine could run
    dtype: DType = DType.FLOAT32
    stream: bool = False  # print a single prompt's text as it is generated
    verify: bool = True  # False: a decomposed folder without its manifest (--no-verify)
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS  # rows per prefill forward (generation.prefill)

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", Engine.parse(self.engine))
        object.__setattr__(self, "dtype", DType.parse(self.dtype))


def _tokenizer(model: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model)


def encode_prompts(job: GenerateJob, tokenizer: Any) -> list[list[int]]:
    """Token ids of every prompt (chat template applied with ``--chat``)."""
    if not job.prompts:
        raise ValueError("give at least one --prompt (or --prompts-file)")
    out = []
    for i, text in enumerate(job.prompts):
        if not text.strip():
            raise ValueError(f"prompt {i + 1} is empty; every prompt needs some text")
        if job.chat:
            ids = list(tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                return_dict=True)["input_ids"])
        else:
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        out.append(list(ids))
    return out


def eos_ids(model: Path, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids from generation_config.json (else the tokenizer's)."""
    import json

    ids: Any = None
    gen = model / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset(ids if isinstance(ids, list) else [ids])


def validate(job: GenerateJob, prompt_ids: list[list[int]]) -> None:
    """Everything that can be checked before ranks start (the weights' manifest included) — for
    ``--layout auto``, before it is priced: a first ``auto`` run on a host calibrates for tens of
    seconds and times matrix products at the model's own shapes, so a bad input or a folder that
    fails verification is refused first, and sizes that fit under no layout are refused before
    any of those shapes is allocated. The chosen plan's own checks follow (``check_layout``)."""
    from deinfer_megatron.checkpoints.folder import open_config, open_model
    from deinfer_megatron.generation.context import slot_length

    if job.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {job.max_new_tokens}")
    job.cache.check_budget()
    check_max_tokens(job.max_prefill_tokens)
    arch, ranks = open_config(job.model, verify=job.verify)
    if job.cache.kind is CacheKind.LATENT and not ranks.modules:
        raise ValueError(
            f"--kv-cache latent needs a decomposed model; {job.model} is dense "
            "(decompose it with `deinfer-megatron decompose`, or use --kv-cache full)"
        )
    needed = max(map(len, prompt_ids)) + job.max_new_tokens
    slot_length(needed, max_positions=arch.max_positions, bytes_per_token=0, slots=len(prompt_ids), budget_gb=None)
    if job.parallel.layout == AUTO:  # the plan is checked once chosen: here (prepare) or in the ranks
        from deinfer_megatron.planning.preflight import check_fits

        check_fits(arch, ranks, AUTO, tp=job.parallel.tp, pp=job.parallel.pp, dtype_bytes=job.dtype.itemsize,
                   kv_cache=job.cache.kind, **memory_sizes(job, prompt_ids))
    else:
        check_layout(job, prompt_ids, arch, ranks)
    open_model(job.model, verify=job.verify)  # manifest, shapes


def check_layout(job: GenerateJob, prompt_ids: list[list[int]], arch: Any, ranks: Any) -> None:
    """What depends on the (resolved) layout: the latent cache's support and whether the weights
    and KV cache fit. Sizes before weights: a wrong config.json is refused before anything is read
    or allocated."""
    from deinfer_megatron.planning.preflight import check_fits

    par = job.parallel
    if job.cache.kind is CacheKind.LATENT and not par.layout.supports_latent_cache:
        raise ValueError(f"--kv-cache latent needs --layout {latent_cache_layouts()} (whole latents on every rank)")
    check_fits(arch, ranks, par.layout, tp=par.tp, pp=par.pp, dtype_bytes=job.dtype.itemsize,
               kv_cache=job.cache.kind, **memory_sizes(job, prompt_ids))


def memory_sizes(job: GenerateJob, prompt_ids: list[list[int]]) -> dict[str, int]:
    """What the memory check (``planning.preflight``) sizes besides the weights: KV tokens of
    every slot, and the rows and keys of the largest prefill forward, whose logits are those of
    each sequence's last row (Megatron's static context materialises no others)."""
    needed = max(map(len, prompt_ids)) + job.max_new_tokens
    shortest = min(map(len, prompt_ids))
    return {"kv_tokens": len(prompt_ids) * needed, "context": shortest, "logit_rows": len(prompt_ids),
            "prefill_rows": largest_forward_rows(len(prompt_ids), shortest, job.max_prefill_tokens)}


def kv_bytes_per_token(stage: Any, kind: CacheKind) -> int:
    """KV bytes one token costs on this rank (this stage's layers), from the planner; a layer
    without a latent width (a dense one) keeps full K/V under the latent cache too."""
    from deinfer_megatron.planning.plan import make_plan

    plan = make_plan(stage.arch, stage.rank_config, stage.layout, tp=stage.groups.tp_size,
                     pp=stage.groups.pp_size, dtype_bytes=stage.model.config.params_dtype.itemsize)
    layers = plan.layers[stage.layer_offset : stage.layer_offset + stage.num_local_layers]
    total = 0
    for layer in layers:
        kv = layer.kv_bytes_per_token
        latent = kv[CacheKind.LATENT.value]
        total += latent if kind is CacheKind.LATENT and latent is not None else kv[CacheKind.FULL.value]
    return total


def _stop_check(tokenizer: Any, stops: tuple[str, ...]) -> Any:
    if not stops:
        return None
    return lambda row, ids: any(s in tokenizer.decode(ids, skip_special_tokens=True) for s in stops)


def _streamer(tokenizer: Any) -> Any:
    """Print a single prompt's text as it is generated (global rank 0 only)."""
    state = {"ids": [], "printed": 0}

    def on_token(row: int, token: int) -> None:
        state["ids"].append(token)
        text = tokenizer.decode(state["ids"], skip_special_tokens=True)
        sys.stdout.write(text[state["printed"] :])
        sys.stdout.flush()
        state["printed"] = len(text)

    return on_token


def _rank(job: GenerateJob, prompt_ids: list[list[int]]) -> dict[str, Any] | None:
    from deinfer_megatron.generation.context import GenerationContext, describe, slot_length
    from deinfer_megatron.generation.loop import generate_tokens
    from deinfer_megatron.generation.megatron_engine import engine_supports, generate_with_engine
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown

    par, cache = job.parallel, job.cache
    tokenizer = _tokenizer(job.model)
    agree = needs_agreement(par.layout)  # launched with auto: rank 0's plan, for every rank
    measured = None  # the TP group's collective rates that plan was priced with
    mine = plan_on_rank0(lambda: auto_plan_for(job, prompt_ids)) if agree else None
    groups = init_parallel(par.tp, par.pp, collectives=par.collectives)
    try:
        if agree:
            from deinfer_megatron.checkpoints.folder import open_config

            plan, measured = plan_in_job(lambda link: auto_plan_for(job, prompt_ids, collectives=link), mine, groups)
            job = replace(job, parallel=replace(par, layout=plan))
            par = job.parallel
            check_layout(job, prompt_ids, *open_config(job.model, verify=False))
        stage = load_folder(job.model, par.layout, groups, dtype=job.dtype.torch, verify=False)  # prepare() verified
        if stage.layout.value == AUTO:  # logged by the ranks: a command that fails earlier prints one line
            log.info("--layout auto: %s", stage.layout.describe())
        tokens = slot_length(
            max(map(len, prompt_ids)) + job.max_new_tokens, max_positions=stage.arch.max_positions,
            bytes_per_token=kv_bytes_per_token(stage, cache.kind), slots=len(prompt_ids),
            budget_gb=cache.budget_gb)
        context = GenerationContext(len(prompt_ids), tokens, kv_cache=cache.kind,
                                    absorb_values=cache.absorb_values)
        if job.engine is Engine.DEEPSPEED:
            from deinfer_megatron.generation.deepspeed_engine import wrap_with_deepspeed

            stage.runner = wrap_with_deepspeed(stage.model, groups, job.dtype.torch)
        eos = eos_ids(job.model, tokenizer)
        reporter = groups.global_rank == 0
        kwargs = dict(max_new_tokens=job.max_new_tokens, params=job.sampling, context=context,
                      eos_ids=eos, stop=_stop_check(tokenizer, job.stop),
                      on_token=_streamer(tokenizer) if job.stream and reporter else None,
                      max_prefill_tokens=job.max_prefill_tokens)
        why_not = "--own-loop" if job.own_loop else engine_supports(job.sampling, eos)
        if why_not is None:
            outputs, timing = generate_with_engine(stage, prompt_ids, model=stage.runner, **kwargs)
            driver = "megatron-static-engine"
        else:
            if job.own_loop is False:
                log.info("generating with the project's loop: %s", why_not)
            outputs, timing = generate_tokens(stage, prompt_ids, **kwargs)
            driver = "deinfer-loop"
        if job.stream and reporter:
            sys.stdout.write("\n")
        allocated = describe(context)
        peak = torch.tensor([allocated["kv_cache_bytes"]], dtype=torch.float64, device=stage.device)
        comm.max_over_world(peak)
    finally:
        shutdown()
    if not reporter:
        return None
    return {
        "outputs": _texts(job, tokenizer, outputs),
        "timing": {"prefill_s": timing.prefill_s, "decode_tokens_per_s": timing.decode_tokens_per_s,
                   "decode_s": timing.decode_s},
        "kv_cache_bytes": int(peak.item()),
        "kv_bytes_per_token": allocated["kv_bytes_per_token"],
        "driver": driver,
        "engine": job.engine.value,
        "layout": par.layout.value, **_block_layouts(par.layout), "kv_cache": cache.kind.value, "tp": par.tp, "pp": par.pp,
        "collectives": groups.transport.kind,  # what carried rank 0's TP collectives
        **({"auto_collectives": measured} if measured else {}),  # [latency s, bytes/s] per kind
    }


def _block_layouts(layout: Any) -> dict[str, Any]:
    """Per-block layouts of a resolved ``--layout auto`` (nothing for a fixed layout)."""
    return {"block_layouts": layout.to_json()} if hasattr(layout, "to_json") else {}


def _texts(job: GenerateJob, tokenizer: Any, outputs: list[Any]) -> list[dict[str, Any]]:
    """Each prompt's result: its ids decoded once, here on the reporting rank, and cut before
    the first ``--stop`` string."""
    results = []
    for text, out in zip(job.prompts, outputs):
        decoded = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        for s in job.stop:
            if s in decoded:
                decoded = decoded[: decoded.index(s)]
        results.append({"prompt": text, "token_ids": out.token_ids, "text": decoded,
                        "finish_reason": out.finish_reason})
    return results


def auto_plan_for(job: GenerateJob, prompt_ids: list[list[int]],
                  collectives: dict[str, list[float]] | None = None) -> Any:
    """The cost model's plan for ``job``'s batch (the prompts) and context (the longest prompt
    plus the new tokens), from this host's cost table (its collectives replaced by
    ``collectives`` where the job measured its own TP group), among the plans whose weights and
    KV cache fit this machine where one does (``planning.auto.within_memory``)."""
    from deinfer_megatron.checkpoints.folder import open_config
    from deinfer_megatron.planning import preflight
    from deinfer_megatron.planning.auto import Workload, auto_plan

    arch, ranks = open_config(job.model, verify=False)  # validate() verifies
    context = max(map(len, prompt_ids)) + job.max_new_tokens
    work = Workload(tp=job.parallel.tp, batch=len(prompt_ids), context=context, dtype=job.dtype.value,
                    latent_cache=job.cache.kind is CacheKind.LATENT)
    sizes = dict(tp=job.parallel.tp, pp=job.parallel.pp, dtype_bytes=job.dtype.itemsize,
                 kv_cache=job.cache.kind, **memory_sizes(job, prompt_ids))
    return auto_plan(arch, ranks, work, collectives=collectives,
                     fits=lambda plan: preflight.fits(arch, ranks, plan, **sizes)).plan


def resolve_layout(job: GenerateJob, prompt_ids: list[list[int]]) -> GenerateJob:
    """``job`` with ``--layout auto`` replaced by the cost model's plan (``auto_plan_for``), once,
    here — except in a rank a launcher started, where ``auto`` is kept and resolved inside the
    ranks, rank 0's plan for all (``planning.agree``); other layouts unchanged."""
    from deinfer_megatron.launch.env import detect

    if job.parallel.layout != AUTO or detect() is not None:
        return job
    return replace(job, parallel=replace(job.parallel, layout=auto_plan_for(job, prompt_ids)))


def prepare(job: GenerateJob) -> tuple[GenerateJob, list[list[int]]]:
    """Check ``job``, tokenise its prompts and resolve ``--layout auto`` (``resolve_layout``),
    before any rank starts: the job as its ranks run it, and the prompts' token ids."""
    from deinfer_megatron.arch.model import load_arch
    from deinfer_megatron.checkpoints.folder import open_config

    load_arch(job.model)  # a missing folder or config.json is named before the tokenizer is read
    prompt_ids = encode_prompts(job, _tokenizer(job.model))
    validate(job, prompt_ids)
    resolved = resolve_layout(job, prompt_ids)
    if resolved is not job:  # auto, priced here: what depends on the plan it chose
        check_layout(resolved, prompt_ids, *open_config(job.model, verify=False))  # validate() verified
    return resolved, prompt_ids


def run_generate(job: GenerateJob) -> dict[str, Any] | None:
    """Generate for ``job``; the result on the reporting process, None on other ranks."""
    job, prompt_ids = prepare(job)
    return run_on_ranks(job.parallel.world, _rank, job, prompt_ids)
