"""The ``generate`` job: text prompts in, generated text out, on TP×PP ranks.

Prompts are tokenised (and checked) before any rank starts, so bad input fails in a second; the
job then goes through the runtime (``runtime.job``: checks, one layout plan, the ranks). Each
rank sizes the KV cache (one slot per prompt; tokens per slot from the request or from
``--kv-budget-gb``) and generates with Megatron's static engine — or the project's loop for what
that engine cannot carry. Global rank 0 streams a single prompt's text as it is generated and
returns the result.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deinfer_megatron.arch.model import ModelArch, load_arch
from deinfer_megatron.generation.context import GenerationContext, describe, slot_length
from deinfer_megatron.generation.loop import generate_tokens
from deinfer_megatron.generation.megatron_engine import engine_supports, generate_with_engine
from deinfer_megatron.generation.options import CacheOptions
from deinfer_megatron.generation.prefill import DEFAULT_MAX_PREFILL_TOKENS, check_max_tokens, largest_forward_rows
from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.parallel import comm
from deinfer_megatron.planning.pricing import Workload
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.planning.preflight import Footprint
from deinfer_megatron.runtime.job import RankContext, check_job, prepare, run_prepared
from deinfer_megatron.runtime.options import DType, Engine, Parallelism
from deinfer_megatron.specs.layout import LayoutPlan, latent_cache_layouts
from deinfer_megatron.specs.rank_config import RankConfig

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


@dataclass(frozen=True)
class Generation:
    """The runtime's view of a ``generate`` job (``runtime.job.JobSpec``): the job and its
    prompts as token ids."""

    job: GenerateJob
    prompt_ids: tuple[tuple[int, ...], ...]

    model = property(lambda self: self.job.model)
    parallel = property(lambda self: self.job.parallel)
    dtype = property(lambda self: self.job.dtype)
    engine = property(lambda self: self.job.engine)
    verify = property(lambda self: self.job.verify)

    @property
    def needed(self) -> int:
        """Tokens the longest sequence reaches: its prompt and every new token."""
        return max(map(len, self.prompt_ids)) + self.job.max_new_tokens

    def check(self, arch: ModelArch, rank_config: RankConfig) -> None:
        job = self.job
        if job.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {job.max_new_tokens}")
        job.cache.check_budget()
        check_max_tokens(job.max_prefill_tokens)
        if job.cache.kind is CacheKind.LATENT and not rank_config.modules:
            raise ValueError(
                f"--kv-cache latent needs a decomposed model; {job.model} is dense "
                "(decompose it with `deinfer-megatron decompose`, or use --kv-cache full)"
            )
        slot_length(self.needed, max_positions=arch.max_positions, bytes_per_token=0,
                    slots=len(self.prompt_ids), budget_gb=None)

    def workload(self) -> Workload:
        """A decode step of every prompt at once, attending to the longest prompt plus the new tokens."""
        return Workload(tp=self.job.parallel.tp, batch=len(self.prompt_ids), context=self.needed,
                        dtype=self.job.dtype.value, latent_cache=self.job.cache.kind is CacheKind.LATENT)

    def footprint(self, arch: ModelArch) -> Footprint:
        """KV tokens of every slot, and the rows and keys of the largest prefill forward, whose
        logits are those of each sequence's last row (Megatron's static context keeps no others)."""
        shortest = min(map(len, self.prompt_ids))
        return Footprint(kv_tokens=len(self.prompt_ids) * self.needed, kv_cache=self.job.cache.kind,
                         prefill_rows=largest_forward_rows(len(self.prompt_ids), shortest,
                                                           self.job.max_prefill_tokens),
                         context=shortest, logit_rows=len(self.prompt_ids))

    def check_plan(self, plan: LayoutPlan) -> None:
        if self.job.cache.kind is CacheKind.LATENT and not plan.supports_latent_cache:
            raise ValueError(f"--kv-cache latent needs --layout {latent_cache_layouts()} (whole latents on every rank)")


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


def kv_bytes_per_token(stage: Any, kind: CacheKind) -> int:
    """KV bytes one token costs on this rank (this stage's layers), from the planner; a layer
    without a latent width (a dense one) keeps full K/V under the latent cache too."""
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


def _generate_on_rank(ctx: RankContext) -> dict[str, Any] | None:
    """One rank of the job (``runtime.job.run_prepared``'s body): the result on global rank 0."""
    spec: Generation = ctx.spec
    job, stage = spec.job, ctx.stage
    prompt_ids = [list(p) for p in spec.prompt_ids]
    tokenizer = _tokenizer(job.model)
    tokens = slot_length(spec.needed, max_positions=stage.arch.max_positions,
                         bytes_per_token=kv_bytes_per_token(stage, job.cache.kind), slots=len(prompt_ids),
                         budget_gb=job.cache.budget_gb)
    context = GenerationContext(len(prompt_ids), tokens, kv_cache=job.cache.kind,
                                absorb_values=job.cache.absorb_values)
    eos = eos_ids(job.model, tokenizer)
    kwargs = dict(max_new_tokens=job.max_new_tokens, params=job.sampling, context=context,
                  eos_ids=eos, stop=_stop_check(tokenizer, job.stop),
                  on_token=_streamer(tokenizer) if job.stream and ctx.reports else None,
                  max_prefill_tokens=job.max_prefill_tokens)
    why_not = "--own-loop" if job.own_loop else engine_supports(job.sampling, eos)
    if why_not is None:
        outputs, timing = generate_with_engine(stage, prompt_ids, **kwargs)
        driver = "megatron-static-engine"
    else:
        if job.own_loop is False:
            log.info("generating with the project's loop: %s", why_not)
        outputs, timing = generate_tokens(stage, prompt_ids, **kwargs)
        driver = "deinfer-loop"
    if job.stream and ctx.reports:
        sys.stdout.write("\n")
    allocated = describe(context)
    peak = torch.tensor([allocated["kv_cache_bytes"]], dtype=torch.float64, device=stage.device)
    comm.max_over_world(peak)
    if not ctx.reports:
        return None
    par = job.parallel
    return {
        "outputs": _texts(job, tokenizer, outputs),
        "timing": {"prefill_s": timing.prefill_s, "decode_tokens_per_s": timing.decode_tokens_per_s,
                   "decode_s": timing.decode_s},
        "kv_cache_bytes": int(peak.item()),
        "kv_bytes_per_token": allocated["kv_bytes_per_token"],
        "driver": driver,
        "engine": job.engine.value,
        "layout": ctx.plan.name,
        **({"block_layouts": ctx.plan.to_json()} if par.layout.is_auto else {}),  # auto's choice per block
        "kv_cache": job.cache.kind.value, "tp": par.tp, "pp": par.pp, "dtype": job.dtype.value,
        "collectives": ctx.groups.transport.kind,  # what carried rank 0's TP collectives
        **({"auto_collectives": ctx.link} if ctx.link else {}),  # [latency s, bytes/s] per kind
    }


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


def generation(job: GenerateJob) -> Generation:
    """``job`` with its prompts tokenised (a missing folder or config.json is named first)."""
    load_arch(job.model)
    return Generation(job, tuple(tuple(ids) for ids in encode_prompts(job, _tokenizer(job.model))))


def validate(job: GenerateJob) -> None:
    """Every check ``run_generate`` makes before its ranks start, without choosing a plan (a
    command that starts a launcher: the launched ranks choose it)."""
    check_job(generation(job))


def run_generate(job: GenerateJob) -> dict[str, Any] | None:
    """Generate for ``job``; the result on the reporting process, None on other ranks."""
    return run_prepared(prepare(generation(job)), _generate_on_rank)
