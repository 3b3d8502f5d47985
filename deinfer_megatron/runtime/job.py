"""One runtime for every job that runs a model on ranks: ``generate``, ``eval-ppl``, ``serve``,
``heal`` (logit distillation) and each cell of ``bench``.

Every such job goes the same way, written once here:

1. ``prepare``, in the command's process before any rank starts: the folder's config and rank
   config (verified against its manifest), the TP/PP sizes (``check_parallel_sizes``, the one
   check of them), the job's own input (``JobSpec.check``); one ``LayoutPlan`` — a fixed
   layout's, known at once, or ``auto``'s, priced for the job's ``workload`` among the plans
   that fit once every weight file's checksum and shape is checked (``Prepared.choose``) — and
   its checks (``Prepared.check``: the job's own, then the one memory check of the plan, made
   before any weight file is read where the plan needs no pricing). Bad input fails here, in
   one line.
2. ``run_prepared``, on every rank (``launch.run.run_on_ranks``): ``init_parallel`` →
   ``load_folder(plan)`` → the engine (``runtime.engines``) → the job's body → ``shutdown``.

Under an external launcher (torchrun, the DeepSpeed launcher, srun) every rank runs the command,
so ranks on different hosts could price ``auto`` differently: a launched ``auto`` job is resolved
inside the ranks instead, by global rank 0 alone, and its plan reaches every rank in one
broadcast (``runtime.agree``); every rank then checks the plan against its own machine.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.checkpoints.folder import open_config, open_model
from deinfer_megatron.launch.env import detect
from deinfer_megatron.launch.run import global_rank, run_on_ranks
from deinfer_megatron.models.build import Stage, load_folder
from deinfer_megatron.parallel.runtime import ParallelGroups, init_parallel, shutdown
from deinfer_megatron.parallel.topology import check_parallel_sizes
from deinfer_megatron.planning.auto import resolve_layout, unpriced_plan
from deinfer_megatron.planning.pricing import Workload
from deinfer_megatron.planning.preflight import Footprint, MemoryBudget
from deinfer_megatron.runtime.agree import plan_in_job, plan_on_rank0
from deinfer_megatron.runtime.engines import driven_by
from deinfer_megatron.runtime.options import DType, Engine, Parallelism, warn_if_emulated
from deinfer_megatron.specs.layout import LayoutPlan
from deinfer_megatron.specs.rank_config import RankConfig

log = logging.getLogger(__name__)
Rates = dict[str, list[float]]  # measured collective rates: {kind: [latency s, bytes/s]}


class JobSpec(Protocol):
    """What a command tells the runtime about its job (a frozen, picklable dataclass: it crosses
    to spawned ranks)."""

    model: Path
    parallel: Parallelism
    dtype: DType
    engine: Engine
    verify: bool  # False: a decomposed folder without its manifest (``--no-verify``)

    def check(self, arch: ModelArch, rank_config: RankConfig) -> None:
        """The job's own input against the model (lengths, options): ValueError in one line."""

    def workload(self) -> Workload:
        """What ``--layout auto`` prices: the job's decode step (batch, context, cache)."""

    def footprint(self, arch: ModelArch) -> Footprint:
        """What the job holds besides the weights (KV cache, largest forward): the memory check."""

    def check_plan(self, plan: LayoutPlan) -> None:
        """What the job needs of the plan it will build (e.g. the latent cache's layout)."""


@dataclass(frozen=True)
class Prepared:
    """A checked job and its plan; ``plan`` is None for ``auto`` under a launcher (the ranks
    agree on it)."""

    spec: JobSpec
    arch: ModelArch
    rank_config: RankConfig
    plan: LayoutPlan | None

    @property
    def budget(self) -> MemoryBudget:
        par = self.spec.parallel
        return MemoryBudget(self.arch, self.rank_config, par.tp, par.pp, self.spec.dtype.itemsize,
                            self.spec.footprint(self.arch))

    def choose(self, collectives: Rates | None = None) -> LayoutPlan:
        """The plan for the request (``planning.auto.resolve_layout``); ``collectives``: the TP
        group's measured rates in place of the host table's (a launched job)."""
        budget = self.budget
        return resolve_layout(self.spec.parallel.layout, self.arch, self.rank_config, self.spec.workload(),
                              budget.fits, collectives)

    def check(self, plan: LayoutPlan) -> None:
        """The job's checks of ``plan``, then the memory check (one line each)."""
        self.spec.check_plan(plan)
        self.budget.check(plan)


@dataclass(frozen=True)
class RankContext:
    """What a job's body gets on every rank: the plan, the loaded stage (driven by the job's
    engine), the groups, the seconds from the rank's start to a loaded stage, the TP group's
    measured rates (a launched ``auto``; else None), and what ``before_groups`` opened (None
    without it)."""

    spec: Any
    plan: LayoutPlan
    stage: Stage
    groups: ParallelGroups
    load_s: float = 0.0
    link: Rates | None = None
    opened: Any = None

    @property
    def reports(self) -> bool:
        """Global rank 0: the rank whose result the command prints."""
        return self.groups.global_rank == 0


def check_job(spec: JobSpec, opened: tuple[ModelArch, RankConfig] | None = None) -> Prepared:
    """Every check of ``spec`` before its plan is priced (step 1 of the module docstring): what a
    command that starts a launcher makes before the launched ranks choose the plan. Sizes before
    weights: the memory check of a plan known without pricing (a fixed layout's) runs before any
    weight file is hashed, so a wrong config.json is refused in a second.

    ``opened``: the folder's architecture and rank config where the caller opened and verified
    it already (``bench``, once for all its cells); the folder is then not read again."""
    if opened is None:
        arch, rank_config = open_config(spec.model, verify=spec.verify)
    else:
        arch, rank_config = opened
    check_parallel_sizes(arch, spec.parallel.tp, spec.parallel.pp)
    spec.check(arch, rank_config)
    warn_if_emulated(spec.dtype)
    prepared = Prepared(spec, arch, rank_config, None)
    plan = unpriced_plan(spec.parallel.layout, arch.num_layers, prepared.budget.fits)
    if plan is not None:
        prepared.check(plan)  # auto's fallback where nothing fits: raises, naming what is missing
    if opened is None:
        open_model(spec.model, verify=spec.verify)  # every file's checksum and shape, before any pricing
    return replace(prepared, plan=plan)


def prepare(spec: JobSpec, opened: tuple[ModelArch, RankConfig] | None = None,
            collectives: Rates | None = None) -> Prepared:
    """Check ``spec`` and resolve its plan (see the module docstring); the plan stays None for
    ``auto`` inside a launched rank. ``collectives``: rates of the link the ranks will use, in
    place of the host table's local ones (a bench across two nodes measures them first)."""
    prepared = check_job(spec, opened)
    if prepared.plan is not None or detect() is not None:  # known without pricing, or the ranks agree on it
        return prepared
    plan = prepared.choose(collectives)
    prepared.check(plan)
    return replace(prepared, plan=plan)


Body = Callable[..., Any]


def run_prepared(prepared: Prepared, body: Body, *args: Any, timeout: float | None = None,
                 before_groups: Callable[[int], ContextManager[Any]] | None = None) -> Any | None:
    """``body(RankContext, *args)`` on every rank of ``prepared``'s job; global rank 0's result
    where it reports, None elsewhere.

    ``before_groups(global rank)``: a context entered on each rank before the process groups
    exist and left after they are gone (``serve`` binds its HTTP port there, before gloo's own
    sockets take ports); its value is ``RankContext.opened``. ``body``, ``args`` and
    ``before_groups`` cross to spawned ranks: module-level functions and picklable values."""
    return run_on_ranks(prepared.spec.parallel.world, _rank_main, prepared, body, args, before_groups,
                        timeout=timeout)


def run_job(spec: JobSpec, body: Body, *args: Any, **kwargs: Any) -> Any | None:
    """``prepare`` then ``run_prepared``."""
    return run_prepared(prepare(spec), body, *args, **kwargs)


def _rank_main(prepared: Prepared, body: Body, args: tuple,
               before_groups: Callable[[int], ContextManager[Any]] | None) -> Any:
    spec, par = prepared.spec, prepared.spec.parallel
    start, rank = time.perf_counter(), global_rank()
    # A launched auto job: rank 0 prices before the groups exist, so that a calibration it needs
    # forks its measuring processes from a process without communication threads.
    first = plan_on_rank0(prepared.choose, rank) if prepared.plan is None else None
    with before_groups(rank) if before_groups is not None else contextlib.nullcontext() as opened:
        groups = init_parallel(par.tp, par.pp, collectives=par.collectives)
        try:
            plan, link = prepared.plan, None
            if plan is None:
                plan, link = plan_in_job(prepared.choose, first, groups)
                prepared.check(plan)  # on every rank: its own machine's memory
            stage = load_folder(spec.model, plan, groups, dtype=spec.dtype.torch, verify=False)  # prepare() verified
            if par.layout.is_auto:  # logged by the ranks: a command that fails earlier prints one line
                log.info("--layout auto: %s", plan.describe())
            stage = driven_by(spec.engine, stage, spec.dtype.torch)
            ctx = RankContext(spec, plan, stage, groups, time.perf_counter() - start, link, opened)
            return body(ctx, *args)
        finally:
            shutdown()
