"""``--layout auto``: the fastest layout for every block, as this host's cost table predicts it.

``resolve_layout`` turns a job's ``LayoutRequest`` into the one ``LayoutPlan`` it builds: a fixed
layout's, or ``auto``'s — the cheapest layout per attention and MLP block for the job's batch and
context (``planning.pricing.choose_layouts``), priced by this host's table (``planning.host``:
measured once, cached), among the plans that fit in memory. Where the table cannot be measured,
``auto`` falls back to ``FALLBACK`` with one warning line.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.planning import host
from deinfer_megatron.planning.cost_model import CostTable
from deinfer_megatron.planning.pricing import (
    CANDIDATES,
    AutoChoice,
    Workload,
    choose_layouts,
    required_attention,
    required_gemms,
    within_memory,
)
from deinfer_megatron.planning.request import LayoutRequest
from deinfer_megatron.specs.layout import Layout, LayoutPlan
from deinfer_megatron.specs.rank_config import RankConfig

FALLBACK = Layout.DEINFER  # where no cost table can be measured: the method's own layout
log = logging.getLogger(__name__)


def table_for(arch: ModelArch, rank_config: RankConfig, work: Workload) -> CostTable:
    """This host's cached table with every shape and attention ``work``'s pricing needs measured."""
    return host.host_table(tp=work.tp, gemms=required_gemms(arch, rank_config, work),
                      attention=required_attention(arch, rank_config, work), dtype=work.dtype)


def auto_plan(arch: ModelArch, rank_config: RankConfig, work: Workload,
              table: CostTable | None = None, collectives: dict[str, list[float]] | None = None,
              fits: Callable[[LayoutPlan], bool] | None = None) -> AutoChoice:
    """``choose_layouts`` with this host's cached (or freshly measured) table when none is given;
    ``collectives`` (rates measured in the job's own TP group, ``runtime.agree``) replace the
    table's for this choice only — never cached under the host's key; ``fits`` (whether a plan's
    weights and KV cache fit the machine, ``preflight.fits``): the plan is one that does
    where some fixed layout does (``within_memory``).

    A model without a decomposed block has nothing to choose (every block is Megatron's dense one
    in every layout): its plan is the dense layout, named so, and no table is read or measured."""
    if not rank_config.modules:
        return AutoChoice(LayoutPlan.uniform(Layout.DENSE, arch.num_layers), [])
    if table is None:
        try:
            table = table_for(arch, rank_config, work)
        except host.CalibrationFailed as err:  # the default layout must not fail where a fixed one runs
            if not err.warned:  # the same failure comes back each time a job prices: said once
                err.warned = True
                log.warning("--layout auto: %s; using the %s layout for every block (pass a fixed "
                            "--layout to choose another)", err, FALLBACK.value)
            return AutoChoice(LayoutPlan.uniform(FALLBACK, arch.num_layers), [])
    if collectives:
        table = replace(table, collectives=collectives)
    choice = choose_layouts(arch, rank_config, work, table)
    return within_memory(choice, fits) if fits is not None else choice


def unpriced_plan(request: LayoutRequest, num_layers: int, fits: Callable[[LayoutPlan], bool]) -> LayoutPlan | None:
    """The plan known without pricing: a fixed layout's uniform plan; for ``auto``, the fallback
    layout's where no fixed layout fits (the job's memory check then says what is missing), else
    None (``auto`` must be priced). A first pricing on a host calibrates for tens of seconds and
    times matrix products at the model's own shapes, which sizes that fit under no layout must
    not reach."""
    if not request.is_auto:
        return LayoutPlan.uniform(request.fixed, num_layers)
    if not any(fits(LayoutPlan.uniform(c, num_layers)) for c in CANDIDATES):
        return LayoutPlan.uniform(FALLBACK, num_layers)
    return None


def resolve_layout(request: LayoutRequest, arch: ModelArch, rank_config: RankConfig, work: Workload,
                   fits: Callable[[LayoutPlan], bool], collectives: dict[str, list[float]] | None = None) -> LayoutPlan:
    """The one ``LayoutPlan`` a job builds for ``request``: ``unpriced_plan`` where it is known,
    else ``auto``'s choice among the plans that ``fits`` accepts (``auto_plan``)."""
    plan = unpriced_plan(request, arch.num_layers, fits)
    if plan is not None:
        return plan
    return auto_plan(arch, rank_config, work, collectives=collectives, fits=fits).plan
