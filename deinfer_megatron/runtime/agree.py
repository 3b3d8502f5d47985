"""One ``--layout auto`` plan for every rank of a launched job.

Under torchrun, the DeepSpeed launcher or srun every rank runs the command. Were each to resolve
``auto`` itself, ranks on different hosts (or with different cached cost tables, or timing
calibrations run side by side) could build different plans — mismatched shards and collectives:
wrong tokens or a hang. So a launched job resolves ``auto`` once: global rank 0 prices the plan
(``plan_on_rank0``, before the process groups exist, so that a calibration it may need forks
its measuring processes from a process without communication threads), and once the groups
exist every rank takes rank 0's plan (``agreed_plan``, a broadcast of its JSON). An error on
rank 0 travels the same way, so every rank ends with it instead of waiting for a plan.

Between the two, every rank measures the job's own TP group (``measure_tp_collectives``: an
all-reduce and an all-gather at two sizes, best of a few, through the transport the model will
use), and rank 0 prices the plan with those rates in place of its host table's local
shared-memory ones: a TP group spanning two nodes is priced with its link, not as if its ranks
shared memory. The measured rates serve that one resolution and are never cached (the host
table's key names one host, not the set of hosts a group spans).

Jobs whose ranks this process spawns itself (``launch.local``) resolve ``auto`` once in the
parent, before the ranks start, and pass the plan down: they never reach this module's broadcast.
A fixed layout needs no agreement: every rank builds the same uniform plan.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from deinfer_megatron.parallel import comm
from deinfer_megatron.parallel.topology import TPView
from deinfer_megatron.planning.calibrate import CacheFlush, cold_median, line_through
from deinfer_megatron.specs.layout import LayoutPlan

log = logging.getLogger(__name__)
SIZES = (64, 1 << 17)  # float32 elements of the measured collectives: the latency end, the bandwidth end
REPEATS = 15  # a fixed count, the same on every rank (a time budget would differ by rank and hang)
Message = dict[str, Any]  # {"plan": LayoutPlan.to_json(), "name": its name} or {"error": one line}


def plan_on_rank0(resolve: Callable[[], LayoutPlan], rank: int) -> Message | None:
    """Global rank 0's plan (``resolve()``) or its error as a message; None on the other ranks.

    Runs before torch.distributed is initialised: ``rank`` is the launcher's (``launch.run``)."""
    if rank != 0:
        return None
    try:
        plan = resolve()
        return {"plan": plan.to_json(), "name": plan.name}
    except (ValueError, RuntimeError, OSError) as err:  # the peers must hear of it, not wait
        return {"error": str(err)}


def agreed_plan(mine: Message | None, device: torch.device) -> LayoutPlan:
    """Rank 0's plan on every rank of the job (``mine``: rank 0's message, None elsewhere).

    Raises:
        RuntimeError: rank 0 could not price a plan (its message, on every rank)."""
    source = json.dumps(mine).encode() if dist.get_rank() == 0 else None
    if dist.get_rank() == 0 and mine is None:
        raise AssertionError("global rank 0 prices the plan before the groups exist (plan_on_rank0)")
    doc = json.loads(comm.broadcast_bytes(source, 0, device).decode())
    if "error" in doc:
        raise RuntimeError(f"--layout auto: rank 0 could not choose a plan: {doc['error']}")
    return LayoutPlan.from_json(doc["plan"], doc["name"])


def measure_tp_collectives(tp: Any, device: torch.device) -> dict[str, list[float]]:
    """``[latency s, bytes/s]`` per kind (``CostTable.collectives``) of this job's TP group
    ``tp`` (a ``TPView``), through its installed transport; the slowest group's times when the
    job has several. Every rank of the job calls it (a second or less).

    Each size's time is the median of the repeats, not the best: across a network link the best
    of a few is half the typical one (a TCP round trip that found both peers ready; a burst that
    a rate limiter let through at line rate — 190 MB/s "measured" on a 1 Gbit/s link), while a
    decode step pays the typical one, and a bench reports medians. On CPU each call follows a
    cache flush, as in the host table (``planning.calibrate``)."""
    flush = CacheFlush() if device.type == "cpu" else None  # as the host table times them: cold
    typical: list[float] = []
    for kind in ("all_reduce", "all_gather"):
        for n in SIZES:
            x = torch.zeros(n, device=device)

            def call() -> None:
                if kind == "all_reduce":
                    comm.all_reduce_sum(x, tp, site="auto.measure", layer=-1)
                else:
                    comm.all_gather_last_dim(x, tp, site="auto.measure", layer=-1)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)

            typical.append(cold_median(call, lambda: comm.barrier(tp), flush, REPEATS))
    worst = comm.max_over_world(torch.tensor(typical, dtype=torch.float64, device=device)).tolist()
    return {kind: line_through(kind, SIZES, (worst[2 * i], worst[2 * i + 1]), tp.size)
            for i, kind in enumerate(("all_reduce", "all_gather"))}


def plan_in_job(price: Callable[[dict[str, list[float]] | None], LayoutPlan], first: Message | None,
                groups: Any) -> tuple[LayoutPlan, dict[str, list[float]] | None]:
    """Rank 0's plan on every rank — one broadcast — priced with the TP group's own measured
    collectives; and those rates (None at TP 1, where nothing is sent).

    Args:
        price: on rank 0, the plan with these collective rates in place of the host table's.
        first: rank 0's ``plan_on_rank0`` message from before the groups existed (its host table,
            calibrated there if it had to be, is cached by then); None on the other ranks.
        groups: the job's ``ParallelGroups``."""
    mine, link = first, None
    if groups.tp_size > 1:  # every rank measures, whatever rank 0's first answer was
        tp = TPView(groups.tp_rank, groups.tp_size, groups.pg_collection.tp)
        link = measure_tp_collectives(tp, groups.device)
        if first is not None and "plan" in first and math.isfinite(link["all_reduce"][1]):
            log.info("--layout auto: the TP group's collectives, measured in the job: %s",
                     ", ".join(f"{k} {v[0] * 1e6:.0f} us + {v[1] / 1e9:.2f} GB/s" for k, v in link.items()))
            mine = plan_on_rank0(lambda: price(link), dist.get_rank())
    return agreed_plan(mine, groups.device), link
