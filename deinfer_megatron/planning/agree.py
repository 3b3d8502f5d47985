"""One ``--layout auto`` plan for every rank of a launched job.

Under torchrun, the DeepSpeed launcher or srun every rank runs the command. Were each to resolve
``auto`` itself, ranks on different hosts (or with different cached cost tables, or timing
calibrations run side by side) could build different plans — mismatched shards and collectives:
wrong tokens or a hang. So a launched job resolves ``auto`` once: global rank 0 prices the plan
(``plan_on_rank0``, before the process groups exist, so that a calibration it may need forks
its measuring processes from a process without communication threads), and once the groups
exist every rank takes rank 0's plan (``agreed_plan``, a broadcast of its JSON). An error on
rank 0 travels the same way, so every rank ends with it instead of waiting for a plan.

Jobs whose ranks this process spawns itself (``launch.local``) resolve ``auto`` once in the
parent, before the ranks start, and pass the plan down: they never reach this module's broadcast.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch

from deinfer_megatron.specs.layout import AUTO, LayoutPlan

Message = dict[str, Any]  # {"plan": LayoutPlan.to_json(), "name": its name} or {"error": one line}


def needs_agreement(layout: Any) -> bool:
    """``layout`` is still ``auto`` inside a rank: a launched job, resolved by ``agreed_plan``."""
    return isinstance(layout, str) and layout == AUTO


def plan_on_rank0(resolve: Callable[[], LayoutPlan]) -> Message | None:
    """Global rank 0's plan (``resolve()``) or its error as a message; None on the other ranks.

    Reads ``RANK`` (exported from the launcher's variables before the job runs): it runs before
    torch.distributed is initialised."""
    if int(os.environ.get("RANK", "0")) != 0:
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
    import torch.distributed as dist

    from deinfer_megatron.parallel import comm

    source = json.dumps(mine).encode() if dist.get_rank() == 0 else None
    if dist.get_rank() == 0 and mine is None:
        raise AssertionError("global rank 0 prices the plan before the groups exist (plan_on_rank0)")
    doc = json.loads(comm.broadcast_bytes(source, 0, device).decode())
    if "error" in doc:
        raise RuntimeError(f"--layout auto: rank 0 could not choose a plan: {doc['error']}")
    return LayoutPlan.from_json(doc["plan"], doc["name"])
