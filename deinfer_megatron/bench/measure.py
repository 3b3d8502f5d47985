"""What runs inside the ranks of one bench cell: load, generate ``repeats + 1`` times, measure.

Timings come from the project's own loop (``generate_tokens``, greedy, no EOS), observed through
its ``on_token`` callback: the first token of every step is a timestamp, so TTFT is the time to
the first token and each later step is exactly one decode forward plus sampling. The first run
is a warm-up; it is also the run whose second step (one decode forward) is recorded in the
collectives ledger, so the timed runs carry no recording at all.

Peak RSS is read from ``/proc/self/status`` (VmHWM) after loading, then the high-water mark is
reset (``/proc/self/clear_refs``) so that a second figure covers generation alone; where Linux
does not allow the reset, that figure is None. ``resource.getrusage`` is the fallback reader.
"""

from __future__ import annotations

import pickle
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.bench.profile import profile_run
from deinfer_megatron.bench.records import DecodeStepComm, RankMeasurement, Sample
from deinfer_megatron.generation.context import GenerationContext, describe
from deinfer_megatron.generation.loop import generate_tokens
from deinfer_megatron.generation.prefill import DEFAULT_MAX_PREFILL_TOKENS, largest_forward_rows
from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.parallel import comm
from deinfer_megatron.parallel.topology import TPView
from deinfer_megatron.planning.pricing import Workload
from deinfer_megatron.planning.preflight import Footprint
from deinfer_megatron.runtime.job import RankContext
from deinfer_megatron.runtime.options import DType, Engine, Parallelism
from deinfer_megatron.specs.layout import LayoutPlan, latent_cache_layouts
from deinfer_megatron.specs.rank_config import RankConfig


@dataclass(frozen=True)
class CellJob:
    """One configuration, as every rank runs it (``runtime.job.JobSpec``; picklable)."""

    model: Path
    parallel: Parallelism  # TP, PP 1, the cell's layout request and the transport
    kv_cache: CacheKind
    batch: int
    prompt_len: int
    gen_len: int
    repeats: int
    prompts: tuple[tuple[int, ...], ...]  # batch × prompt_len random ids, the same on every rank
    profile: bool = False  # one more run, its first decode step profiled (bench.profile)
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS  # rows per prefill forward (generation.prefill)
    dtype: DType = DType.FLOAT32  # weights, factors and KV caches (``bench --dtype``)
    engine = Engine.MEGATRON
    verify = False  # the bench verified the folder once (bench.sources)

    @property
    def tp(self) -> int:
        return self.parallel.tp

    def check(self, arch: ModelArch, rank_config: RankConfig) -> None:
        check_lengths(arch, self.prompt_len, self.gen_len)

    def workload(self) -> Workload:
        return Workload(tp=self.tp, batch=self.batch, context=self.prompt_len + self.gen_len,
                        dtype=self.dtype.value, latent_cache=self.kv_cache is CacheKind.LATENT)

    def footprint(self, arch: ModelArch) -> Footprint:
        return Footprint(kv_tokens=self.batch * (self.prompt_len + self.gen_len), kv_cache=self.kv_cache,
                         prefill_rows=largest_forward_rows(self.batch, self.prompt_len, self.max_prefill_tokens),
                         context=self.prompt_len, logit_rows=self.batch)

    def check_plan(self, plan: LayoutPlan) -> None:
        if self.kv_cache is CacheKind.LATENT and not plan.supports_latent_cache:
            raise ValueError(f"the latent KV cache applies to the {latent_cache_layouts()} layout only")


def check_lengths(arch: ModelArch, prompt_len: int, gen_len: int) -> None:
    """A prompt and its new tokens must fit the model's context."""
    needed = prompt_len + gen_len
    if needed > arch.max_positions:
        raise ValueError(f"--prompt-len {prompt_len} + --gen-len {gen_len} = {needed} exceeds "
                         f"the model's context of {arch.max_positions} tokens; lower one of them")


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (since the last reset, where one happened)."""
    kb = _status_kb("VmHWM")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kb * 1024


def reset_peak_rss() -> bool:
    """Start a new high-water mark (Linux ≥ 4.0); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class StepProbe:
    """``on_token`` hook: a timestamp per generated step, and one decode step in a ledger.

    Every row generates on every step (equal prompt lengths, no EOS), so calls arrive in groups
    of ``batch``; the first call of a group marks its step. With ``record``, the ledger is open
    from the first step's mark to the second's: exactly the forward of one decode step.
    """

    def __init__(self, batch: int, record: bool) -> None:
        self.batch = batch
        self.calls = 0
        self.marks: list[float] = []
        self.ledger = comm.CommLedger() if record else None
        self._recording: Any = None

    def on_token(self, row: int, token: int) -> None:
        if self.calls % self.batch == 0:
            self.marks.append(time.perf_counter())
            step = len(self.marks) - 1
            if self.ledger is not None and step == 0:
                self._recording = comm.recording(self.ledger)
                self._recording.__enter__()
            elif step == 1:
                self.close()
        self.calls += 1

    def close(self) -> None:
        if self._recording is not None:
            self._recording.__exit__(None, None, None)
            self._recording = None


def _one_run(stage: Any, job: CellJob, context: Any, record: bool) -> tuple[Sample, Any]:
    probe = StepProbe(job.batch, record)
    start = time.perf_counter()
    try:
        outputs, timing = generate_tokens(stage, [list(p) for p in job.prompts], max_new_tokens=job.gen_len,
                                          params=SamplingParams(), context=context, on_token=probe.on_token,
                                          max_prefill_tokens=job.max_prefill_tokens)
    finally:
        probe.close()
    new_tokens = sum(len(o.token_ids) for o in outputs)
    assert new_tokens == job.batch * job.gen_len, f"generated {new_tokens} tokens, expected batch × gen-len"
    marks = probe.marks
    steps = [b - a for a, b in zip(marks, marks[1:])]
    sample = Sample(
        ttft_s=marks[0] - start,
        prefill_s=timing.prefill_s,
        decode_s=marks[-1] - marks[0],
        tpot_s=(marks[-1] - marks[0]) / len(steps),
        step_s=tuple(steps),
        new_tokens=new_tokens,
    )
    return sample, probe.ledger


def _ledger_summary(ledger: Any) -> DecodeStepComm:
    kinds: dict[str, int] = {}
    for rec in ledger.records:
        kinds[rec.kind] = kinds.get(rec.kind, 0) + 1
    return DecodeStepComm(collectives=len(ledger.records),
                          elements=sum(r.elements_per_token for r in ledger.records),
                          by_kind=kinds,
                          tokens_per_collective=tuple(sorted({r.tokens for r in ledger.records})))


def measure_cell(ctx: RankContext) -> list[RankMeasurement] | None:
    """One cell on this rank (``runtime.job.run_prepared``'s body); every rank's measurements,
    by TP rank, on global rank 0 (the one the runtime reports), None on the others."""
    job, stage = ctx.spec, ctx.stage
    rss_after_load = peak_rss_bytes()
    reset = reset_peak_rss()
    context = GenerationContext(job.batch, job.prompt_len + job.gen_len, kv_cache=job.kv_cache)
    warmup, ledger = _one_run(stage, job, context, record=True)
    samples = tuple(_one_run(stage, job, context, record=False)[0] for _ in range(job.repeats))
    profile = None
    if job.profile:

        profile = profile_run(stage, job, context, TPView.of(ctx.groups.pg_collection.tp))
    cache = describe(context)
    rss_run = peak_rss_bytes() if reset else None
    mine = RankMeasurement(
        tp_rank=ctx.groups.tp_rank,
        load_s=ctx.load_s,
        warmup=warmup,
        samples=samples,
        decode_step_comm=_ledger_summary(ledger),
        peak_rss_bytes=max(rss_after_load, rss_run or 0),
        peak_rss_generate_bytes=rss_run,
        kv_cache_bytes=cache["kv_cache_bytes"],
        kv_bytes_per_token=cache["kv_bytes_per_token"],
        profile=profile,
    )
    every = [pickle.loads(b) for b in comm.gather_bytes(pickle.dumps(mine), stage.device)]
    return sorted(every, key=lambda m: m.tp_rank) if ctx.reports else None
