"""The bench's records as typed values, each with ``to_json()`` giving the documented schema.

A cell is measured in its ranks (``RankMeasurement``: the samples of every run, memory, the
collectives of one decode step), summarised in the parent (``Summary``), and kept with its plan
and outcome in a ``CellRecord``. The JSON (README, "bench") is exactly what these produce: the
enums are written by value, tuples as lists, and a key that a record does not carry (a skipped
cell's plan, a non-deinfer cell's speed-ups) is left out rather than written as null.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.planning.request import LayoutRequest


class CellStatus(str, Enum):
    OK = "ok"
    SKIPPED = "skipped"  # does not apply to this model (the reason is recorded)
    ERROR = "error"  # failed; the matrix went on


class Peer(str, Enum):
    """Another implementation timed beside the cells (``bench.peers``)."""

    HF = "hf"
    DEEPSPEED = "deepspeed"

    @classmethod
    def parse(cls, text: str) -> "Peer":
        return cls(text)


def first_line(err: BaseException) -> str:
    """A failed cell's or peer's error as recorded: its type and the first line of its message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


@dataclass(frozen=True)
class Cell:
    """One point of the grid: (layout, KV cache, TP, batch, prompt length)."""

    layout: LayoutRequest  # a fixed layout, or auto (resolved per cell by the cost model); names are parsed
    kv_cache: CacheKind
    tp: int
    batch: int
    prompt_len: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", LayoutRequest.parse(self.layout))

    @property
    def layout_name(self) -> str:
        return self.layout.name

    def label(self) -> str:
        return f"{self.layout_name}/{self.kv_cache.value} tp={self.tp} b={self.batch} ctx={self.prompt_len}"

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout_name, "kv_cache": self.kv_cache.value, "tp": self.tp,
                "batch": self.batch, "prompt_len": self.prompt_len}


@dataclass(frozen=True)
class PlanTotals:
    """The planner's per-token figures for a cell (what ``plan`` would print)."""

    collectives_per_token: int
    elements_per_token: int
    params_per_rank: int
    kv_bytes_per_token: int  # of the cell's KV cache
    collective_ops: tuple[tuple[str, int], ...]  # (kind, elements per token), layer by layer

    def to_json(self) -> dict[str, Any]:
        return {"collectives_per_token": self.collectives_per_token, "elements_per_token": self.elements_per_token,
                "params_per_rank": self.params_per_rank, "kv_bytes_per_token": self.kv_bytes_per_token,
                "collective_ops": [list(op) for op in self.collective_ops]}


@dataclass(frozen=True)
class Sample:
    """One generation run on one rank."""

    ttft_s: float
    prefill_s: float
    decode_s: float
    tpot_s: float
    step_s: tuple[float, ...]  # every decode step
    new_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "tpot_s": self.tpot_s, "step_s": list(self.step_s), "new_tokens": self.new_tokens}


@dataclass(frozen=True)
class DecodeStepComm:
    """The collectives of one decode step, from the comm ledger."""

    collectives: int
    elements: int
    by_kind: dict[str, int]
    tokens_per_collective: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"collectives": self.collectives, "elements": self.elements, "by_kind": dict(self.by_kind),
                "tokens_per_collective": list(self.tokens_per_collective)}


@dataclass(frozen=True)
class RankMeasurement:
    """Everything one rank measured in a cell (returned from the rank, so picklable)."""

    tp_rank: int
    load_s: float
    warmup: Sample
    samples: tuple[Sample, ...]
    decode_step_comm: DecodeStepComm
    peak_rss_bytes: int
    peak_rss_generate_bytes: int | None  # None where Linux would not reset the high-water mark
    kv_cache_bytes: int
    kv_bytes_per_token: int
    profile: Any = None  # bench.profile.RankProfile with --profile

    def to_json(self) -> dict[str, Any]:
        out = {"tp_rank": self.tp_rank, "load_s": self.load_s, "warmup": self.warmup.to_json(),
               "samples": [s.to_json() for s in self.samples],
               "decode_step_comm": self.decode_step_comm.to_json(), "peak_rss_bytes": self.peak_rss_bytes,
               "peak_rss_generate_bytes": self.peak_rss_generate_bytes, "kv_cache_bytes": self.kv_cache_bytes,
               "kv_bytes_per_token": self.kv_bytes_per_token}
        if self.profile is not None:
            out["profile"] = self.profile.to_json()
        return out


@dataclass(frozen=True)
class Speedups:
    """The deinfer layout's decode tokens/s ÷ a baseline's (None: that baseline was not measured)."""

    vs_naive: float | None
    vs_dense: float | None


@dataclass(frozen=True)
class Summary:
    """A measured cell in figures: rank 0's medians over the timed repeats, every rank's memory."""

    ttft_s: float
    prefill_s: float
    tpot_s: float
    tpot_min_s: float
    tpot_max_s: float
    decode_tokens_per_s: float
    output_tokens_per_s: float
    peak_rss_bytes: tuple[int, ...]
    peak_rss_generate_bytes: tuple[int | None, ...]
    peak_rss_max_bytes: int
    kv_cache_bytes: int
    kv_cache_bytes_per_rank: tuple[int, ...]
    kv_bytes_per_token: int
    collectives_per_token: int
    elements_per_token: int
    collectives_by_kind: dict[str, int]
    plan_collectives_per_token: int
    plan_elements_per_token: int
    plan_match: bool
    load_s: float
    speedups: Speedups | None = None  # deinfer cells only, once compared

    def to_json(self) -> dict[str, Any]:
        out = {"ttft_s": self.ttft_s, "prefill_s": self.prefill_s, "tpot_s": self.tpot_s,
               "tpot_min_s": self.tpot_min_s, "tpot_max_s": self.tpot_max_s,
               "decode_tokens_per_s": self.decode_tokens_per_s, "output_tokens_per_s": self.output_tokens_per_s,
               "peak_rss_bytes": list(self.peak_rss_bytes), "peak_rss_generate_bytes": list(self.peak_rss_generate_bytes),
               "peak_rss_max_bytes": self.peak_rss_max_bytes, "kv_cache_bytes": self.kv_cache_bytes,
               "kv_cache_bytes_per_rank": list(self.kv_cache_bytes_per_rank),
               "kv_bytes_per_token": self.kv_bytes_per_token, "collectives_per_token": self.collectives_per_token,
               "elements_per_token": self.elements_per_token, "collectives_by_kind": dict(self.collectives_by_kind),
               "plan_collectives_per_token": self.plan_collectives_per_token,
               "plan_elements_per_token": self.plan_elements_per_token, "plan_match": self.plan_match,
               "load_s": self.load_s}
        if self.speedups is not None:
            out["speedup_vs_naive"] = self.speedups.vs_naive
            out["speedup_vs_dense"] = self.speedups.vs_dense
        return out


@dataclass(frozen=True)
class StepBound:
    """The roofline's lower bound on one decode step, beside the measured step."""

    weight_bytes: int
    kv_bytes: int
    memory_s: float
    collectives: int
    comm_s: float
    compute_s: float
    bound_s: float
    bound_with_compute_s: float
    measured_s: float
    measured_over_bound: float | None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Prediction:
    """The cost model's decode step for a cell's plan (``planning.auto``) beside the measured
    TPOT; ``predicted_over_measured`` 1.0 is a perfect prediction."""

    predicted_s: float
    measured_s: float
    predicted_over_measured: float
    chosen: str  # the plan the prediction is for: a fixed layout, or auto's choice per block
    parts: dict[str, float]  # weights_kv_s, collectives_s, fixed_s: what --profile measures apart

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class CellRecord:
    """A cell and what became of it: skipped (``reason``), failed (``error``) or measured."""

    cell: Cell
    gen_len: int
    repeats: int
    status: CellStatus
    plan: PlanTotals | None = None  # every cell that was run
    reason: str | None = None  # skipped
    error: str | None = None  # failed: its one-line error
    wall_s: float | None = None  # every cell that was run
    ranks: tuple[RankMeasurement, ...] = ()
    summary: Summary | None = None
    roofline: StepBound | None = None
    step_profile: tuple[Any, ...] = ()  # bench.profile.StepBreakdown per rank, with --profile
    prediction: "Prediction | None" = None  # the cost model's step beside the measured one

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.cell.to_json(), "gen_len": self.gen_len, "repeats": self.repeats}
        if self.status is CellStatus.SKIPPED:
            return {**out, "status": self.status.value, "reason": self.reason}
        out["plan"] = self.plan.to_json() if self.plan is not None else None
        out["status"] = self.status.value
        if self.status is CellStatus.ERROR:
            return {**out, "error": self.error, "wall_s": self.wall_s}
        out["wall_s"] = self.wall_s
        out["ranks"] = [r.to_json() for r in self.ranks]
        if self.summary is not None:
            out["summary"] = self.summary.to_json()
        if self.roofline is not None:
            out["roofline"] = self.roofline.to_json()
        if self.step_profile:
            out["step_profile"] = [b.to_json() for b in self.step_profile]
        if self.prediction is not None:
            out["prediction"] = self.prediction.to_json()
        return out


@dataclass(frozen=True)
class Comparison:
    """The deinfer layout's decode speed-up in one (TP, batch, prompt length, KV cache)."""

    tp: int
    batch: int
    prompt_len: int
    kv_cache: CacheKind
    deinfer_tokens_per_s: float
    speedups: Speedups

    def to_json(self) -> dict[str, Any]:
        return {"tp": self.tp, "batch": self.batch, "prompt_len": self.prompt_len, "kv_cache": self.kv_cache.value,
                "deinfer_tokens_per_s": self.deinfer_tokens_per_s, "speedup_vs_naive": self.speedups.vs_naive,
                "speedup_vs_dense": self.speedups.vs_dense}


@dataclass(frozen=True)
class PeerMeasurement:
    """Everything one process of a peer measured (``bench --peers``), as a cell's rank does."""

    rank: int
    threads: int  # torch threads it ran with
    load_s: float
    warmup: Sample
    samples: tuple[Sample, ...]
    tokens: tuple[tuple[int, ...], ...]  # the warm-up run's greedy tokens, row by row
    peak_rss_bytes: int
    peak_rss_generate_bytes: int | None

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "threads": self.threads, "load_s": self.load_s, "warmup": self.warmup.to_json(),
                "samples": [s.to_json() for s in self.samples], "tokens": [list(t) for t in self.tokens],
                "peak_rss_bytes": self.peak_rss_bytes, "peak_rss_generate_bytes": self.peak_rss_generate_bytes}


@dataclass(frozen=True)
class PeerSummary:
    """A measured peer in figures: process 0's medians over the timed repeats (as ``Summary``)."""

    ttft_s: float
    prefill_s: float
    tpot_s: float
    tpot_min_s: float
    tpot_max_s: float
    decode_tokens_per_s: float
    output_tokens_per_s: float
    peak_rss_bytes: tuple[int, ...]
    peak_rss_max_bytes: int
    load_s: float

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["peak_rss_bytes"] = list(self.peak_rss_bytes)
        return out


@dataclass(frozen=True)
class PeerRecord:
    """Another implementation run beside the cells of one (TP, batch, prompt length)."""

    peer: str  # "hf" | "deepspeed"
    tp: int  # the cells it stands beside
    batch: int
    prompt_len: int
    gen_len: int
    repeats: int
    processes: int
    threads_per_process: int
    status: CellStatus
    reason: str | None = None  # skipped
    error: str | None = None  # failed: its one-line error
    wall_s: float | None = None
    ranks: tuple[PeerMeasurement, ...] = ()
    summary: PeerSummary | None = None

    def label(self) -> str:
        return f"{self.peer} ({self.processes}×{self.threads_per_process}) tp={self.tp} b={self.batch} ctx={self.prompt_len}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"peer": self.peer, "tp": self.tp, "batch": self.batch, "prompt_len": self.prompt_len,
                               "gen_len": self.gen_len, "repeats": self.repeats, "processes": self.processes,
                               "threads_per_process": self.threads_per_process, "status": self.status.value}
        if self.status is CellStatus.SKIPPED:
            return {**out, "reason": self.reason}
        if self.status is CellStatus.ERROR:
            return {**out, "error": self.error, "wall_s": self.wall_s}
        out["wall_s"] = self.wall_s
        out["ranks"] = [r.to_json() for r in self.ranks]
        if self.summary is not None:
            out["summary"] = self.summary.to_json()
        return out


@dataclass(frozen=True)
class PeerRatio:
    """A layout's decode tokens/s ÷ a peer's, in the same (TP, batch, prompt length)."""

    layout: str
    kv_cache: CacheKind
    peer: str
    tp: int
    batch: int
    prompt_len: int
    layout_tokens_per_s: float
    peer_tokens_per_s: float

    @property
    def ratio(self) -> float:
        return self.layout_tokens_per_s / self.peer_tokens_per_s

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "kv_cache": self.kv_cache.value, "peer": self.peer, "tp": self.tp,
                "batch": self.batch, "prompt_len": self.prompt_len, "layout_tokens_per_s": self.layout_tokens_per_s,
                "peer_tokens_per_s": self.peer_tokens_per_s, "ratio": self.ratio}
