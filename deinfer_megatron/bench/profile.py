"""``bench --profile``: where one decode step's time goes on every TP rank (issue 10, item 1).

After a cell's timed runs, every rank generates once more and profiles the first decode step of
that run (caches warm, the warm-up long done). Each rank's step — from the instant the ranks
leave a barrier to the first sampled token of the next step — is split into:

- ``gemm_s``: matrix products and the attention kernel, from ``torch.profiler`` CPU events
  (``GEMM_OPS``; an event inside another counted one is not counted twice);
- ``collective_wait_s``: time inside the project's collectives spent waiting for the slower
  peer to arrive (load imbalance). Every raw collective's entry and exit instant is taken with
  ``time.perf_counter`` (``parallel.comm.timing``), a clock shared by the processes of one host,
  so the k-th collective's last arrival is the latest entry over the ranks: a rank waits from
  its own entry to that instant;
- ``collective_s``: the collectives' own cost, from the last arrival to this rank's exit;
- ``other_s``: the rest — Python, Megatron's module glue, norms, element-wise ops, sampling, the
  generation loop, Megatron's two vocabulary collectives (they go through torch.distributed,
  not ``parallel.comm``), and the profiler's own overhead.

``other_s`` is what is left, but it is no plug: GEMMs never run inside a collective, so the three
measured parts fall in disjoint stretches of the step and their sum cannot exceed it; the tests
check that, and that the ranks agree on the step. The profiler makes the step slower (a few µs per
operator): the breakdown is of the profiled step (``step_s``), reported beside the unprofiled
median TPOT. Ranks on different hosts do not share the clock; ``bench`` runs local ranks only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from deinfer_megatron.bench.records import CellRecord
from deinfer_megatron.generation.loop import generate_tokens
from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.parallel import comm

GEMM_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv", "aten::matmul",
    "aten::linear", "aten::einsum", "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
})


@dataclass(frozen=True)
class RankProfile:
    """One rank's profiled decode step, raw (the parent lines the ranks' collectives up)."""

    step_start: float  # perf_counter at the barrier's exit
    step_end: float  # perf_counter at the next step's first token
    gemm_s: float
    spans: tuple[tuple[str, float, float], ...]  # (kind, entered, left) of every collective

    def to_json(self) -> dict[str, Any]:
        return {"step_start": self.step_start, "step_end": self.step_end, "gemm_s": self.gemm_s,
                "spans": [list(s) for s in self.spans]}


@dataclass(frozen=True)
class StepBreakdown:
    """One rank's decode step split into its parts (seconds; they sum to ``step_s``)."""

    tp_rank: int
    step_s: float
    gemm_s: float
    collective_wait_s: float
    collective_s: float
    other_s: float
    collectives: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def gemm_seconds(events: Any) -> float:
    """Seconds of the outermost ``GEMM_OPS`` events among a profiler's CPU events."""
    total_us = 0.0
    for ev in events:
        if ev.name not in GEMM_OPS:
            continue
        parent, nested = ev.cpu_parent, False
        while parent is not None:
            if parent.name in GEMM_OPS:
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            total_us += ev.cpu_time_total
    return total_us * 1e-6


class ProfileProbe:
    """``on_token`` hook: profiles from the first token (after a TP barrier) to the second step's
    first token — exactly one decode forward plus its sampling."""

    def __init__(self, batch: int, tp: Any) -> None:
        self.batch, self.tp, self.calls = batch, tp, 0
        self.result: RankProfile | None = None
        self._prof: Any = None
        self._open = False
        self._timing: Any = None
        self._start = 0.0

    def on_token(self, row: int, token: int) -> None:
        if self.calls % self.batch == 0:
            step = self.calls // self.batch
            if step == 0:
                self._begin()
            elif step == 1:
                self._end()
        self.calls += 1

    def _begin(self) -> None:
        import torch

        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._prof.__enter__()
        self._open = True
        comm.barrier(self.tp)  # both ranks start the step together, the profiler already running
        self._timing = comm.timing()
        self._times = self._timing.__enter__()
        self._start = time.perf_counter()

    def _end(self) -> None:
        end = time.perf_counter()
        self.close()
        self.result = RankProfile(self._start, end, gemm_seconds(self._prof.events()),
                                  tuple(self._times.spans))

    def close(self) -> None:
        if self._timing is not None:
            self._timing.__exit__(None, None, None)
            self._timing = None
        if self._open:
            self._open = False
            self._prof.__exit__(None, None, None)


def profile_run(stage: Any, job: Any, context: Any, tp: Any) -> RankProfile:
    """Generate once more (as the timed runs do) and profile its first decode step."""

    probe = ProfileProbe(job.batch, tp)
    try:
        generate_tokens(stage, [list(p) for p in job.prompts], max_new_tokens=job.gen_len,
                        params=SamplingParams(), context=context, on_token=probe.on_token)
    finally:
        probe.close()
    assert probe.result is not None, "a run of --gen-len ≥ 2 has a decode step to profile"
    return probe.result


def breakdown(profiles: list[RankProfile]) -> tuple[StepBreakdown, ...]:
    """Every rank's step split into GEMM, waiting, collectives and the rest (module docstring)."""
    counts = {len(p.spans) for p in profiles}
    assert len(counts) == 1, f"the ranks issued different numbers of collectives: {sorted(counts)}"
    last = [max(p.spans[k][1] for p in profiles) for k in range(counts.pop())]
    out = []
    for rank, p in enumerate(profiles):
        wait = sum(arrived - entered for (_, entered, _), arrived in zip(p.spans, last))
        own = sum(max(left - arrived, 0.0) for (_, _, left), arrived in zip(p.spans, last))
        step = p.step_end - p.step_start
        out.append(StepBreakdown(rank, step, p.gemm_s, wait, own, step - p.gemm_s - wait - own, len(p.spans)))
    return tuple(out)


def cell_breakdown(rec: CellRecord) -> tuple[StepBreakdown, ...]:
    """A measured cell's breakdown, when its ranks profiled (else empty)."""
    profiles = [r.profile for r in rec.ranks]
    if not profiles or any(p is None for p in profiles):
        return ()
    return breakdown(profiles)  # type: ignore[arg-type]


def markdown_lines(records: Any) -> list[str]:
    """The ``--profile`` table: one row per rank of every profiled cell (ms)."""
    rows = [r for r in records if r.step_profile]
    if not rows:
        return []
    lines = ["", "## Where a decode step goes (`--profile`, one profiled step per rank)", "",
             "| layout | tp | batch | ctx | rank | TPOT ms | profiled step ms | GEMM ms | waiting for peer ms "
             "| collectives ms | other (Python, framework) ms | collectives |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, tpot = r.cell, r.summary.tpot_s * 1e3 if r.summary is not None else float("nan")
        for b in r.step_profile:
            lines.append(f"| {c.layout_name} | {c.tp} | {c.batch} | {c.prompt_len} | {b.tp_rank} | {tpot:.2f} | "
                         f"{b.step_s * 1e3:.2f} | {b.gemm_s * 1e3:.2f} | {b.collective_wait_s * 1e3:.2f} | "
                         f"{b.collective_s * 1e3:.2f} | {b.other_s * 1e3:.2f} | {b.collectives} |")
    return lines
