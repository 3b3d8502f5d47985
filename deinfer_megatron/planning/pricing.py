"""Pricing a decode step from a host's cost table: what ``--layout auto`` compares.

The blocks of a transformer layer all start and end with the whole hidden state on every rank,
so each block's layout can be chosen on its own: for each attention and MLP block, every fixed
layout's ``Cost`` (the classes of the layout table, asked by the planner) is priced by the
``CostTable`` for a decode step of the job's batch at its context, on the slowest TP rank, and
the cheapest is taken (ties: the order of ``CANDIDATES``, the layout table's). The result is a
``LayoutPlan``, built and loaded like any fixed layout (``choose_layouts``).

Each block's price includes its layout's fixed framework time (``CostTable.block_overhead``,
measured per TP size), which is what decides at small sizes: a layout with more modules and
collective calls pays more Python per step. The predicted step (``AutoChoice.step_seconds``) is
a whole decode step: the blocks, the fixed time per layer beside them, and what lies outside the
layers, the same in every layout (``outside_seconds``: the output layer's GEMM, Megatron's two
vocabulary collectives at TP > 1 and the fixed time of embedding, final norm and sampling).
Not priced: prefill (one step against the decode steps of a generation).

Every matrix product is priced at its own shape (``Cost.gemms``, ``CostTable.matmul_seconds``)
and every attention over the cache at its core, heads, batch and context (``Cost.attends``,
``CostTable.attention_seconds``): ``required_gemms`` and ``required_attention`` list what a
workload's pricing will ask, so that the host table (``planning.host``) measures those (once,
cached) before ``choose_layouts`` runs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from deinfer_megatron.arch.model import ModelArch, transformer_config
from deinfer_megatron.layers.costs import Attend, Cost, Gemm
from deinfer_megatron.models.build import padded_vocab_size
from deinfer_megatron.parallel.topology import TPView
from deinfer_megatron.planning.cost_model import CostTable, dtype_bytes
from deinfer_megatron.planning.plan import block_costs
from deinfer_megatron.planning.request import AUTO
from deinfer_megatron.specs.layout import FACTOR_CLASSES, BlockLayouts, Layout, LayoutPlan
from deinfer_megatron.specs.rank_config import RankConfig

CANDIDATES = tuple(FACTOR_CLASSES)  # every layout of the table, in its order (ties go to the first)
log = logging.getLogger(__name__)
BLOCKS = ("attention", "mlp")


@dataclass(frozen=True)
class Workload:
    """What a step is priced for: ``batch`` sequences each attending to ``context`` tokens."""

    tp: int
    batch: int = 1
    context: int = 128
    dtype: str = "float32"
    latent_cache: bool = False  # decomposed attention blocks must then keep whole latents

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)


@dataclass
class AutoChoice:
    """The plan and, per layer and block, each candidate's predicted seconds per decode step."""

    plan: LayoutPlan
    seconds: list[dict[str, dict[str, float]]]  # [layer]{block: {layout: s}}
    outside_s: float = 0.0  # the step beside the blocks: per-layer glue and outside the layers

    @property
    def step_seconds(self) -> float:
        """Predicted decode step of the chosen plan (a whole step: the blocks and
        ``outside_s``); NaN when the plan is the fallback of a machine without a cost table."""
        if not self.seconds:
            return math.nan
        return self.outside_s + sum(self.seconds[i][b][getattr(blk, b).value]
                                    for i, blk in enumerate(self.plan.layers) for b in BLOCKS)

    def fixed_step_seconds(self, layout: Layout) -> float | None:
        """Predicted decode step of a fixed layout; None where it cannot run this model."""
        total = self.outside_s
        for layer in self.seconds:
            for b in BLOCKS:
                if layout.value not in layer[b]:
                    return None
                total += layer[b][layout.value]
        return total


def gemm_seconds(table: CostTable, work: Workload, gemms: tuple[Gemm, ...]) -> float:
    """``batch`` rows through each of ``gemms`` (one decode token per sequence), each at its
    own shape's measured time with weights from memory (``CostTable.matmul_seconds``)."""
    return sum(table.matmul_seconds(work.dtype, work.batch, g) for g in gemms)


def output_gemm(arch: ModelArch, tp: int) -> Gemm:
    """Megatron's output layer on one rank: ``F.linear`` by its padded vocabulary rows."""
    return Gemm(arch.hidden_size, padded_vocab_size(arch.vocab_size, tp) // tp, transposed=True)


def block_seconds(table: CostTable, cost: Cost, work: Workload, *, latent_bytes_per_token: int | None = None,
                  overhead_s: float = 0.0) -> float:
    """One block's share of a decode step on one rank (``cost_model``'s formula), with its fixed
    framework time ``overhead_s``: its attention timed at the workload's context
    (``CostTable.attention_seconds``), or under the latent cache (``latent_bytes_per_token``,
    whose K/V are rebuilt from latents) the latents' bytes streamed from memory."""
    t = overhead_s + gemm_seconds(table, work, cost.gemms)
    if latent_bytes_per_token is not None:
        t += table.memory_seconds(work.batch * work.context * latent_bytes_per_token)
    else:
        t += sum(table.attention_seconds(work.dtype, a, work.batch, work.context) for a in cost.attends)
    for c in cost.collectives:
        t += table.collective_seconds(c.kind, work.batch * c.elements * work.dtype_bytes)
    return t


def outside_seconds(table: CostTable, arch: ModelArch, work: Workload) -> float:
    """The step beside the blocks, the same in every layout: the output layer's GEMM (its vocabulary
    rows on one rank), the embedding's all-reduce of h and the logits' all-gather of the padded
    vocabulary at TP > 1 (Megatron's own), and the fixed time per layer and outside the layers."""
    h, vocab = arch.hidden_size, padded_vocab_size(arch.vocab_size, work.tp)
    t = gemm_seconds(table, work, (output_gemm(arch, work.tp),))
    if work.tp > 1:
        t += table.collective_seconds("all_reduce", work.batch * h * work.dtype_bytes)
        t += table.collective_seconds("all_gather", work.batch * vocab * work.dtype_bytes)
    return t + table.outside_overhead(work.tp) + arch.num_layers * table.layer_overhead(work.tp)


def _allowed(layout: Layout, block: str, ranks: Any, arch: ModelArch, work: Workload) -> bool:
    if block == "attention" and layout is Layout.DENSE and arch.num_kv_heads < work.tp:
        return False  # Megatron's dense attention needs a KV head per rank
    if block == "mlp" and layout is Layout.DENSE and arch.ffn_hidden_size % work.tp:
        return False  # Megatron's dense MLP splits its intermediate size evenly
    if block == "attention" and work.latent_cache and ranks is not None:
        return layout.supports_latent_cache  # --kv-cache latent: latents of every decomposed attention
    return True


def layout_costs(config: Any, arch: ModelArch, layout: Layout, ranks: Any, tp: TPView) -> tuple[Cost, Cost]:
    """(attention, MLP) cost of one layer's blocks in ``layout`` on rank ``tp.rank``: a layout
    without factor classes builds Megatron's dense blocks."""
    factored = layout.factor_classes is not None
    return block_costs(config, BlockLayouts(layout, layout), ranks.attention if factored else None,
                       ranks.mlp if factored else None, tp, rotary=arch.rotary)


def _priced_costs(arch: ModelArch, rank_config: RankConfig, work: Workload) -> Iterator[tuple[Any, Layout, tuple[Cost, Cost]]]:
    """(layer ranks, candidate, (attention, MLP) cost on one TP rank) for every distinct layer's
    ranks, every candidate and every TP rank: the costs ``choose_layouts`` prices."""
    config = transformer_config(arch, tp=work.tp, pp=1)
    for ranks in {repr(r): r for r in rank_config.layers}.values():
        for layout in CANDIDATES:
            for rank in range(work.tp):
                yield ranks, layout, layout_costs(config, arch, layout, ranks, TPView(rank, work.tp))


def keeps_latents(layout: Layout, ranks: Any, work: Workload) -> bool:
    """Whether this layer's attention block in ``layout`` caches the rank-r latents (the latent
    cache asked, a decomposed attention, a layout that keeps them whole): priced by their bytes."""
    return work.latent_cache and ranks.attention is not None and layout.supports_latent_cache


def required_gemms(arch: ModelArch, rank_config: RankConfig, work: Workload) -> set[tuple[Gemm, int]]:
    """Every (matrix product, batch rows) that ``choose_layouts`` prices for ``work``."""
    gemms = {output_gemm(arch, work.tp)}
    for _, _, costs in _priced_costs(arch, rank_config, work):
        for cost in costs:
            gemms.update(cost.gemms)
    return {(g, work.batch) for g in gemms}


def required_attention(arch: ModelArch, rank_config: RankConfig, work: Workload) -> set[tuple[Attend, int, int]]:
    """Every (attend, batch, context) that ``choose_layouts`` prices for ``work`` (none for the
    attention blocks that keep latents: ``keeps_latents``)."""
    return {(a, work.batch, work.context) for ranks, layout, costs in _priced_costs(arch, rank_config, work)
            if not keeps_latents(layout, ranks, work) for a in costs[0].attends}


def choose_layouts(arch: ModelArch, rank_config: RankConfig, work: Workload, table: CostTable) -> AutoChoice:
    """Price every candidate for every block and keep the cheapest (see the module docstring);
    ``work.tp`` must split the model (``parallel.topology.check_parallel_sizes``)."""
    config = transformer_config(arch, tp=work.tp, pp=1)
    chosen: list[BlockLayouts] = []
    seconds: list[dict[str, dict[str, float]]] = []
    for index, ranks in enumerate(rank_config.layers):
        layer: dict[str, dict[str, float]] = {b: {} for b in BLOCKS}
        for layout in CANDIDATES:
            attn = ranks.attention if layout.factor_classes is not None else None
            worst = {b: 0.0 for b in BLOCKS}
            for rank in range(work.tp):
                costs = layout_costs(config, arch, layout, ranks, TPView(rank, work.tp))
                latent_bytes = (attn.k + attn.v) * work.dtype_bytes if keeps_latents(layout, ranks, work) else None
                for b, cost, model_ranks in zip(BLOCKS, costs, (ranks.attention, ranks.mlp)):
                    built = layout if model_ranks is not None else Layout.DENSE  # a dense block stays dense
                    fixed = table.block_overhead(work.tp, built.value, b)
                    worst[b] = max(worst[b], block_seconds(
                        table, cost, work, latent_bytes_per_token=latent_bytes if b == "attention" else None,
                        overhead_s=fixed))
            for b, block_ranks in zip(BLOCKS, (ranks.attention, ranks.mlp)):
                if _allowed(layout, b, block_ranks, arch, work):
                    layer[b][layout.value] = worst[b]
        if not layer["attention"]:
            raise ValueError(f"layer {index}: no layout can run its attention block at --tp {work.tp}")
        order = [c.value for c in CANDIDATES]
        pick = {b: Layout(min(layer[b], key=lambda v: (layer[b][v], order.index(v)))) for b in BLOCKS}
        for b, block_ranks in zip(BLOCKS, (ranks.attention, ranks.mlp)):
            if block_ranks is None:  # a dense block of the model is dense in every layout
                pick[b] = Layout.DENSE
        chosen.append(BlockLayouts(pick["attention"], pick["mlp"]))
        seconds.append(layer)
    return AutoChoice(LayoutPlan(tuple(chosen), AUTO), seconds, outside_seconds(table, arch, work))


def within_memory(choice: AutoChoice, fits: Callable[[LayoutPlan], bool]) -> AutoChoice:
    """``choice`` where its plan ``fits`` in memory; else the fixed layout predicted fastest of
    those that fit (the layouts trade bytes differently: naive holds the fewest weights per rank
    but caches every KV head, DeInfer replicates U_o and U_down, dense multiplies the factors
    out), so that the default never refuses a job a fixed layout would run; else ``choice``
    itself, whose fit check then says what is missing."""
    if not choice.seconds or fits(choice.plan):
        return choice
    num_layers = len(choice.plan.layers)
    fixed = sorted((s, i, layout) for i, layout in enumerate(CANDIDATES)
                   if (s := choice.fixed_step_seconds(layout)) is not None)
    for seconds, _, layout in fixed:
        plan = LayoutPlan.uniform(layout, num_layers)
        if fits(plan):
            log.info("--layout auto: the fastest plan (%.1f ms a step) does not fit in memory; "
                     "using %s (%.1f ms predicted)", choice.step_seconds * 1e3, layout.value, seconds * 1e3)
            return AutoChoice(LayoutPlan(plan.layers, AUTO), choice.seconds, choice.outside_s)
    return choice
