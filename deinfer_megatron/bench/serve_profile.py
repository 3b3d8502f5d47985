"""``loadgen --profile``: where one served step's time goes on every TP rank, without HTTP.

On the ranks that ran the static batches, the server's own step machinery (``serving.step``
over a ``layers.paged_cache`` pool) is given ``rows`` sequences whose prompts (``context``
tokens each) are prefilled first; then two steps are profiled as ``bench --profile`` profiles a
decode step (``bench.profile``: ``torch.profiler`` CPU events, every raw collective's entry and
exit): a **decode** step (one token of every row) and a **mixed** step (the same, plus the
first ``chunk`` prompt tokens of one more sequence, as a step that admits a request does). Each
rank's step is split into

- ``gemm_s``: the matrix products (``bench.profile.GEMM_OPS`` without the attention kernel);
- ``attention_s``: the attention kernel and the paged cache's reads and writes (``cache_s``:
  ``aten::index``, ``aten::index_put_``);
- ``collective_wait_s`` / ``collective_s``: waiting for the slower peer, and the collectives'
  own cost (``bench.profile.breakdown``);
- ``other_s``: the rest — Python, Megatron's module glue, norms, RoPE, element-wise ops, the
  step's plan on this rank, sampling.

What the server adds around its steps (scheduling, the plan's broadcast, text and events, HTTP)
is in its own ``/metrics`` (``serving.stats``), which ``loadgen`` reads during the run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from deinfer_megatron.bench.profile import GEMM_OPS, RankProfile, breakdown, gemm_seconds
from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.layers.paged_cache import PagedContext
from deinfer_megatron.parallel import comm
from deinfer_megatron.parallel.topology import TPView
from deinfer_megatron.serving.blocks import blocks_for
from deinfer_megatron.serving.step import Row, StepPlan, StepRunner

ATTENTION_OPS = frozenset({"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu"})
CACHE_OPS = frozenset({"aten::index", "aten::index_put_"})
BLOCK_SIZE = 16


@dataclass(frozen=True)
class StepProfileSpec:
    """The profiled steps: ``rows`` decoding sequences of ``context`` tokens, and a ``chunk`` of
    one more prompt in the mixed step."""

    rows: int
    context: int
    chunk: int
    warmup: int = 2


def _outermost_seconds(events: Any, names: frozenset[str]) -> float:
    total = 0.0
    for ev in events:
        if ev.name in names and (ev.cpu_parent is None or ev.cpu_parent.name not in names):
            total += ev.cpu_time_total
    return total * 1e-6


def _profiled(runner: StepRunner, plan: StepPlan, tp: Any) -> tuple[RankProfile, float, float]:
    """One step under the profiler: (its raw profile, attention seconds, cache seconds)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        comm.barrier(tp)  # the ranks start the step together, the profiler already running
        with comm.timing() as times:
            start = time.perf_counter()
            runner.run(plan)
            end = time.perf_counter()
    events = prof.events()
    attention = _outermost_seconds(events, ATTENTION_OPS)
    return (RankProfile(start, end, gemm_seconds(events) - attention, tuple(times.spans)), attention,
            _outermost_seconds(events, CACHE_OPS))


def profile_served_steps(stage: Any, spec: StepProfileSpec, kv_cache: Any) -> dict[str, Any]:
    """This rank's profiles of a decode and a mixed step (raw; ``summarize`` lines the ranks up)."""
    longest = spec.context + spec.warmup + 2 + max(spec.chunk, 1)
    per_seq = blocks_for(longest, BLOCK_SIZE)
    context = PagedContext((spec.rows + 1) * per_seq, BLOCK_SIZE, longest, kv_cache=kv_cache)
    runner = StepRunner(stage, context)
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(spec.rows + 1)]
    runner.run(StepPlan(start={i: SamplingParams() for i in range(spec.rows + 1)}))
    prompt = tuple(1000 + (7 * k) % 20000 for k in range(max(spec.context, spec.chunk)))
    for i in range(spec.rows):  # every row's prompt in the cache, one row per step
        runner.run(StepPlan(rows=[Row(i, 0, prompt[: spec.context], tables[i], True)]))

    def decode(step: int) -> list[Row]:
        return [Row(i, spec.context + step, (2000 + i,), tables[i], True) for i in range(spec.rows)]

    for step in range(spec.warmup):
        runner.run(StepPlan(rows=decode(step)))
    tp = TPView.of(stage.groups.pg_collection.tp)
    out = {}
    step = spec.warmup
    for name, extra in (("decode", []), ("mixed", [Row(spec.rows, 0, prompt[: spec.chunk], tables[spec.rows], True)])):
        profile, attention, cache = _profiled(runner, StepPlan(rows=decode(step) + extra), tp)
        out[name] = {"profile": profile, "attention_s": attention, "cache_s": cache}
        step += 1
    return out


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Every rank's steps split into GEMM, attention, waiting, collectives and the rest."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name in ("decode", "mixed"):
        parts = breakdown([r[name]["profile"] for r in per_rank])
        out[name] = []
        for b, r in zip(parts, per_rank):
            attention = r[name]["attention_s"] + r[name]["cache_s"]
            out[name].append({"tp_rank": b.tp_rank, "step_s": b.step_s, "gemm_s": b.gemm_s,
                              "attention_s": attention, "cache_s": r[name]["cache_s"],
                              "collective_wait_s": b.collective_wait_s, "collective_s": b.collective_s,
                              "other_s": b.other_s - attention, "collectives": b.collectives})
    return out
