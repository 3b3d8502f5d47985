"""The fixed framework time of a decode step, measured on this machine for the project's own
layers: what the rates of ``cost_model`` cannot price.

At llama-tiny sizes a TP=2 decode step is tens of milliseconds while its GEMMs and collectives are
a fraction of one: the step is Python, Megatron's module glue, and each collective call's own
Python beyond its transport's latency. That time hardly depends on the model's size, so it is
measured where nothing else is left: two tiny LLaMA-shaped models (``sizes(tp)``), every layout, run
on ``tp`` local ranks exactly as a job runs them (``spawn_local``, the job's transport), a short
greedy decode each (the generation loop in small, ``_decode``), timed per decode step with
forward hooks on every layer and on its attention and MLP blocks (hooks time; they issue
nothing), each block after a cache flush, as a real model's block follows one that streamed its
weights, and a barrier, as the previous block's collective lines the ranks up (``BlockTimer``);
every (size, layout) decoded ``ROUNDS`` times, interleaved (``time_stages``). Per step, per rank:

- a block's time is one call of it (the mean over layers);
- a layer's own time is the layer's call minus its two blocks (norms, residual adds);
- the outside is the step minus its layers (embedding, final norm, output layer, sampling, loop).

Each is the median over the decode steps (the statistic ``bench`` reports), then over the rounds,
the slowest rank's.
From each the cost model's own price at that size is taken away (GEMM, attention, collectives'
latency and bandwidth: ``planning.pricing``), and the remainder is extrapolated linearly in the
block's parameters per rank to zero size — what is left at no size at all is the fixed cost. It
is clamped to [0, the larger remainder], as a busy machine can make the line slope down.

The models' heads and KV heads are multiples of ``tp`` (``sizes``), so every TP size a job can ask
for is measured in every layout, dense included (a KV head per rank at least).

Limits: the models are LLaMA-shaped whatever the job's family; a job started by an external
launcher that resolves ``auto`` inside its ranks measures from inside them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from deinfer_megatron.arch.model import arch_from_hf_config, transformer_config
from deinfer_megatron.files.failpoints import point
from deinfer_megatron.launch.local import spawn_local
from deinfer_megatron.models.build import build_stage, load_weights
from deinfer_megatron.models.pipeline import broadcast_from_last_stage, stage_forward
from deinfer_megatron.models.synthetic import random_state
from deinfer_megatron.parallel.runtime import init_parallel, shutdown
from deinfer_megatron.parallel.topology import TPView
from deinfer_megatron.planning.calibrate import CacheFlush
from deinfer_megatron.planning.cost_model import CostTable
from deinfer_megatron.planning.pricing import (
    BLOCKS,
    CANDIDATES,
    Workload,
    choose_layouts,
    layout_costs,
    outside_seconds,
    required_attention as plan_attention,
    required_gemms as plan_gemms,
)
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig

_LLAMA = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              num_hidden_layers=2, vocab_size=256)
HEAD_DIMS = (8, 16)  # the two sizes: the same heads, twice the head dimension
MIN_KV_HEADS = 4
RATIO = 0.6  # parameters kept: every block decomposed, ranks as in the bench's synthetic models
PROMPT, NEW_TOKENS = 8, 16
PARTS = ("attention", "mlp", "layer", "outside")
ROUNDS = 3  # timed decodes of every (size, layout), interleaved (``time_stages``)


@dataclass(frozen=True)
class OverheadJob:
    """What every rank of the calibration runs (picklable)."""

    tp: int
    threads: int
    layouts: tuple[Layout, ...]


class BlockTimer:
    """Forward hooks on every layer and its blocks, and ``step_mark`` that closes a step: per
    decode step, the seconds of each part (module docstring).

    ``flush`` (``calibrate.CacheFlush``), when given, runs before every block and its own time
    is left out of every part: each block then starts with the caches as cold as in a step of a
    model whose blocks stream more than a core's caches hold — at the calibration's tiny sizes
    everything would otherwise stay cached, and a block's Python would be priced at its hot-cache
    cost.

    ``sync`` (a barrier of the TP ranks), when given, runs after the flush and is left out too:
    every rank then enters the block together, as in a real step, where the previous block's
    collective has just lined them up. Without it, a rank whose flush ran longer would keep its
    peer waiting inside the block's first collective, and that wait (the flush's jitter) would be
    priced as fixed time, the more the more collectives a layout makes. docs/INFERENCE.md has the
    measurements with and without both."""

    def __init__(self, layers: Any, flush: Callable[[], Any] | None = None,
                 sync: Callable[[], Any] | None = None) -> None:
        self.layers = list(layers)
        self.flush = flush
        self.sync = sync
        self.steps: list[dict[str, float]] = []
        self._open: dict[int, float] = {}
        self.reset()
        self._handles = []
        for layer in self.layers:
            for name, module in (("layer", layer), ("attention", layer.self_attention), ("mlp", layer.mlp)):
                self._handles.append(module.register_forward_pre_hook(self._enter_block if name != "layer"
                                                                      else self._enter))
                self._handles.append(module.register_forward_hook(self._leave(name)))

    def _enter(self, module: Any, args: Any) -> None:
        self._open[id(module)] = time.perf_counter()

    def _enter_block(self, module: Any, args: Any) -> None:
        start = time.perf_counter()
        if self.flush is not None:
            self.flush()
        if self.sync is not None:
            self.sync()
        self.flushed += time.perf_counter() - start
        self._enter(module, args)

    def _leave(self, name: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            self.calls[name] += time.perf_counter() - self._open.pop(id(module))
        return hook

    def reset(self) -> None:
        """Forget the steps: a new decode starts (its prefill is not a step)."""
        self.steps.clear()
        self.calls: dict[str, float] = {p: 0.0 for p in ("attention", "mlp", "layer")}
        self.flushed = 0.0  # seconds of flushing and syncing inside the layers since the last mark
        self._mark: float | None = None

    def step_mark(self) -> None:
        now = time.perf_counter()
        if self._mark is not None:  # the prefill before the first mark is not a decode step
            n, c = len(self.layers), self.calls
            self.steps.append({"attention": c["attention"] / n, "mlp": c["mlp"] / n,
                               "layer": (c["layer"] - self.flushed - c["attention"] - c["mlp"]) / n,
                               "outside": now - self._mark - c["layer"]})
        self.calls = {p: 0.0 for p in self.calls}
        self.flushed = 0.0
        self._mark = now

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def medians(self) -> dict[str, float]:
        steps = self.steps[1:] or self.steps  # the first decode step still warms caches
        return {p: statistics.median(s[p] for s in steps) for p in PARTS}


def _decode(stage: Any, timer: BlockTimer, batch: int) -> dict[str, float]:
    """Greedy decode of ``NEW_TOKENS`` tokens after a ``PROMPT``-token prefill, timed per step:
    ``timer``'s medians.

    The loop is ``generation.loop``'s in small (prefill, then per step: the next tokens as Python
    ints, a one-token forward through Megatron's static inference context) — that package
    is above this one, and the loop's own bookkeeping per row is a few µs a step.
    """
    import torch
    from megatron.core.inference.contexts.static_context import StaticInferenceContext

    prompts = torch.tensor([[3 + (i * 7 + j) % 200 for j in range(PROMPT)] for i in range(batch)])
    like = torch.zeros(batch, dtype=torch.long)
    timer.reset()
    context = StaticInferenceContext(batch, PROMPT + NEW_TOKENS)
    pos = torch.arange(PROMPT).expand_as(prompts)
    logits = stage_forward(stage, prompts, pos, inference_context=context)
    context.sequence_len_offset += PROMPT
    for step in range(PROMPT, PROMPT + NEW_TOKENS):
        last = logits[:, -1].argmax(-1) if logits is not None else None
        chosen = broadcast_from_last_stage(stage, last, like).tolist()
        timer.step_mark()
        ids = torch.tensor(chosen).view(batch, 1)
        logits = stage_forward(stage, ids, torch.full((batch, 1), step), inference_context=context)
        context.sequence_len_offset += 1
    return timer.medians()


def time_stages(stages: dict[str, Any], *, rounds: int = ROUNDS, batch: int = 1,
                sync: Callable[[], Any] | None = None) -> dict[str, dict[str, float]]:
    """Each stage's parts: every stage decoded once to warm up, then ``rounds`` times in turn,
    the order rotated each round, and each part the median over the rounds.

    Interleaved, so that a drift of the machine (its clock, a neighbour's load, the heap warming)
    spreads over every layout and size instead of landing on whichever was measured last: the
    choice between layouts rests on their differences, which are fractions of a millisecond a
    block. Every rank makes the same calls in the same order (``sync`` is a collective)."""

    flush = CacheFlush()
    timers = {k: BlockTimer(stage.model.decoder.layers, flush=flush, sync=sync) for k, stage in stages.items()}
    keys = list(stages)
    got: dict[str, list[dict[str, float]]] = {k: [] for k in keys}
    try:
        for r in range(rounds + 1):  # round 0 warms up
            shift = r % len(keys)
            for k in keys[shift:] + keys[:shift]:
                medians = _decode(stages[k], timers[k], batch)
                if r:
                    got[k].append(medians)
    finally:
        for timer in timers.values():
            timer.close()
    return {k: {p: statistics.median(m[p] for m in runs) for p in PARTS} for k, runs in got.items()}


def sizes(tp: int) -> tuple[dict[str, Any], ...]:
    """The two calibration models' Hugging Face configs for TP ``tp``: KV heads the smallest
    multiple of ``tp`` of at least ``MIN_KV_HEADS`` (so that every layout splits them, Megatron's
    dense attention too), twice as many query heads, ``HEAD_DIMS`` per size, MLP 2.75 × hidden.
    At TP 1, 2 and 4: 8 heads, 4 KV heads, hidden 64 and 128."""
    if tp < 1:
        raise ValueError(f"TP size {tp} must be at least 1")
    kv = tp * -(-MIN_KV_HEADS // tp)
    return tuple({**_LLAMA, "num_attention_heads": 2 * kv, "num_key_value_heads": kv,
                  "hidden_size": 2 * kv * d, "intermediate_size": 2 * kv * d * 11 // 4} for d in HEAD_DIMS)


def _model(size: dict[str, Any]) -> tuple[Any, Any, dict[str, int]]:
    """A size's architecture and uniform ranks keeping ``RATIO`` of every matrix's parameters."""

    arch = arch_from_hf_config(size)
    ranks = {name: max(1, int(RATIO * m * n / (m + n))) for name, (m, n) in arch.linear_shapes().items()}
    return arch, RankConfig.from_mapping(ranks, arch), ranks


def overhead_worker(job: OverheadJob) -> dict[str, dict[str, float]]:
    """On each rank: ``"<size>/<layout>"`` → the medians of every part (seconds)."""
    import torch
    import torch.distributed as dist

    point("overhead.rank")  # the robustness suite kills a measuring rank here
    torch.set_num_threads(job.threads)
    groups = init_parallel(job.tp, 1)
    try:
        with torch.no_grad():
            stages = {}
            for s, size in enumerate(sizes(job.tp)):
                arch, rank_config, ranks = _model(size)
                state = random_state(arch, ranks)
                for layout in job.layouts:
                    stage = build_stage(arch, rank_config, layout, groups)
                    load_weights(stage, state, rank_config)
                    stages[f"{s}/{layout.value}"] = stage
            return time_stages(stages, sync=dist.barrier)
    finally:
        shutdown()


def required_gemms(tp: int) -> set[tuple[Any, int]]:
    """The matrix products (and batch rows) that ``fit`` prices: both sizes, batch 1."""

    out: set[tuple[Any, int]] = set()
    for size in sizes(tp):
        arch, rank_config, _ = _model(size)
        out |= plan_gemms(arch, rank_config, Workload(tp=tp, batch=1))
    return out


def required_attention(tp: int) -> set[tuple[Any, int, int]]:
    """The attention (batch 1, the fit's context) that ``fit`` prices for both sizes: timed, so
    that the fixed times are what is left beside the attention the cost model times."""

    out: set[tuple[Any, int, int]] = set()
    for size in sizes(tp):
        arch, rank_config, _ = _model(size)
        out |= plan_attention(arch, rank_config, _fit_workload(tp))
    return out


def _fit_workload(tp: int) -> Any:
    """The step ``fit`` prices: batch 1 at the middle of the timed decode's context."""

    return Workload(tp=tp, batch=1, context=PROMPT + NEW_TOKENS // 2)


def _layouts() -> tuple[Layout, ...]:
    return CANDIDATES


def intercept(r1: float, r2: float, p1: float, p2: float) -> float:
    """The line through (p1, r1) and (p2, r2) at p = 0, clamped to [0, max(r1, r2)]."""
    at_zero = r1 - (r2 - r1) * p1 / (p2 - p1) if p2 != p1 else min(r1, r2)
    return min(max(at_zero, 0.0), max(r1, r2, 0.0))


def fit(table: CostTable, tp: int, measured: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The fixed costs (``CostTable.overhead``'s entry for ``tp``) from every size's and layout's
    measured parts (the slowest rank's), less the table's own price at each size."""

    base = replace(table, overhead={})
    work = _fit_workload(tp)
    layouts = sorted({k.split("/")[1] for k in measured})
    residual: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s, size in enumerate(sizes(tp)):
        arch, rank_config, _ = _model(size)
        config = transformer_config(arch, tp=tp, pp=1)
        priced = choose_layouts(arch, rank_config, work, base).seconds[0]
        ranks = rank_config.layers[0]
        for layout in layouts:
            got = measured[f"{s}/{layout}"]
            costs = layout_costs(config, arch, Layout(layout), ranks, TPView(0, tp))
            for b, cost in zip(BLOCKS, costs):
                residual.setdefault((layout, b), []).append((cost.params, got[b] - priced[b][layout]))
            residual.setdefault((layout, "layer"), []).append((arch.hidden_size, got["layer"]))
            residual.setdefault((layout, "outside"), []).append(
                (arch.vocab_size * arch.hidden_size, got["outside"] - outside_seconds(base, arch, work)))

    def fixed(key: tuple[str, str]) -> float:
        (p1, r1), (p2, r2) = residual[key]
        return intercept(r1, r2, p1, p2)

    return {"blocks": {l: {b: fixed((l, b)) for b in BLOCKS} for l in layouts},
            "layer": statistics.median(fixed((l, "layer")) for l in layouts),
            "outside": statistics.median(fixed((l, "outside")) for l in layouts)}


def measure_overhead(table: CostTable, tp: int, *, timeout_s: float = 300.0) -> dict[str, Any]:
    """``table``'s overhead entry for TP ``tp``, measured on ``tp`` local ranks (tens of seconds)."""

    job = OverheadJob(tp, table.key.threads, _layouts())
    per_rank = spawn_local(tp, overhead_worker, job, timeout=timeout_s)
    slowest = {k: {p: max(r[k][p] for r in per_rank) for p in PARTS} for k in per_rank[0]}
    return fit(table, tp, slowest)
