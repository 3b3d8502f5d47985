"""Will the job fit in memory? Answered from the plan, before a single tensor is allocated.

A config.json with a wrong size (``hidden_size`` 10⁹, say) would otherwise surface as an
allocator failure — or the kernel's OOM killer — deep inside a rank. The planner already knows
the parameters each rank holds and the KV bytes per token; against the memory this machine has
available (``MemAvailable``, or the cgroup's limit when lower) that is a one-line refusal.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.specs.layout import AUTO
from deinfer_megatron.specs.rank_config import RankConfig

_GIB = 2**30


def available_bytes() -> int | None:
    """Memory this process may still use: ``MemAvailable``, capped by a cgroup v2 limit."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit.isdigit():
            avail = min(avail or int(limit), int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def check_fits(
    arch: ModelArch,
    rank_config: RankConfig,
    layout: str,
    *,
    tp: int,
    pp: int,
    dtype_bytes: int,
    kv_tokens: int = 0,
    kv_cache: str = "full",
    ranks_here: int | None = None,
    available: int | None = None,
) -> int:
    """Bytes the ranks on this machine need (weights + KV cache); ValueError if more than
    ``available`` (default: what the machine has now).

    ``layout`` may be ``auto`` before it is priced (the pricing times matrix products at the
    model's own shapes, so sizes that fit under no layout are refused first): then the job must
    fit under at least one of ``auto``'s candidates — the first that does is answered, else the
    first candidate's error — and the chosen plan is checked again once it is known.

    ``ranks_here``: ranks sharing this machine (default: ``LOCAL_WORLD_SIZE`` under a launcher
    that sets it, else all ``tp × pp``).
    """
    sizes = dict(tp=tp, pp=pp, dtype_bytes=dtype_bytes, kv_tokens=kv_tokens, kv_cache=kv_cache,
                 ranks_here=ranks_here, available=available)
    if layout != AUTO:
        return _check_one(arch, rank_config, layout, **sizes)
    from deinfer_megatron.planning.auto import CANDIDATES

    errors = []
    for candidate in CANDIDATES:
        try:
            return _check_one(arch, rank_config, candidate, **sizes)
        except ValueError as err:
            errors.append(err)
    raise errors[0]


def fits(arch: ModelArch, rank_config: RankConfig, layout: Any, **sizes: Any) -> bool:
    """Whether ``check_fits`` accepts ``layout`` (a fixed layout or a plan) at these sizes."""
    try:
        check_fits(arch, rank_config, layout, **sizes)
    except ValueError:
        return False
    return True


def _check_one(arch: ModelArch, rank_config: RankConfig, layout: str, *, tp: int, pp: int, dtype_bytes: int,
               kv_tokens: int, kv_cache: str, ranks_here: int | None, available: int | None) -> int:
    plan = make_plan(arch, rank_config, layout, tp=tp, pp=pp, dtype_bytes=dtype_bytes)
    kv = plan.totals["kv_bytes_per_token"]["latent" if kv_cache == "latent" else "full"]
    per_rank = plan.totals["params_per_rank"] * dtype_bytes + kv * kv_tokens
    here = ranks_here or int(os.environ.get("LOCAL_WORLD_SIZE", tp * pp))
    need = per_rank * here
    available = available_bytes() if available is None else available
    if available is not None and need > available:
        raise ValueError(
            f"the model needs about {need / _GIB:.3g} GiB here ({per_rank / _GIB:.3g} GiB of weights and KV "
            f"cache per rank × {here} ranks) but {available / _GIB:.3g} GiB is available; check the sizes in "
            f"config.json (hidden_size {arch.hidden_size}, intermediate_size {arch.ffn_hidden_size}, "
            f"{arch.num_layers} layers) or spread the job over more machines"
        )
    return need
