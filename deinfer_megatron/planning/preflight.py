"""Will the job fit in memory? Answered from the plan, before a single tensor is allocated.

A config.json with a wrong size (``hidden_size`` 10⁹, say) would otherwise surface as an
allocator failure — or the kernel's OOM killer — deep inside a rank. The planner already knows
the parameters each rank holds, the KV bytes per token and the activations per token row of its
widest layer; against the memory this machine has available (``MemAvailable``, or the cgroup's
limit when lower) that is a one-line refusal.

The activations are those of the largest forward, the prefill's (``prefill_rows`` token rows,
at most ``--max-prefill-tokens``: ``generation.prefill``). The planner's count is a lower bound
(outputs of the products, residual stream and norm); what a rank's peak RSS really grows by per
row is about ``ACTIVATION_FACTOR`` times it — measured at llama-1b-shape, TP=1, batch 8 × 2048
tokens, 2048 to 16,384 rows per forward: 3.3× for deinfer, 2.0× for dense besides its scores
(the rest is copies for RoPE and the attention layout, and the allocator's slack). Scores a core
materialises (Megatron's attention) are counted at their size, ``rows × heads × context`` twice.
Logits are counted apart (``plan.logit_elements``), as the vocabulary is the model's widest
dimension (SmolLM2: 49,152 against a hidden size of 576): for every row of a perplexity pass,
for the last row of each sequence in generation (Megatron's static context keeps only those).
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
ACTIVATION_FACTOR = 3.5  # peak RSS per prefill row ÷ the planner's activation count, rounded up (above)


def activation_bytes(totals: dict[str, Any], rows: int, context: int, dtype_bytes: int,
                     logit_rows: int | None = None) -> int:
    """Peak activation bytes of a forward of ``rows`` token rows over ``context`` keys that
    returns logits for ``logit_rows`` rows (default: every row)."""
    per_row = ACTIVATION_FACTOR * totals["activation_elements_per_token"] + totals["score_heads"] * context
    logits = totals["logit_elements_per_token"] * (rows if logit_rows is None else logit_rows)
    return int((rows * per_row + logits) * dtype_bytes)


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
    prefill_rows: int = 0,
    context: int = 0,
    logit_rows: int | None = None,
    rows_option: str = "--max-prefill-tokens",
    ranks_here: int | None = None,
    available: int | None = None,
) -> int:
    """Bytes the ranks on this machine need (weights + KV cache + the activations of a forward of
    ``prefill_rows`` token rows over ``context`` keys, with vocabulary-wide logits for
    ``logit_rows`` rows, default ``prefill_rows``); ValueError if more than ``available``
    (default: what the machine has now), naming ``rows_option``, the command's option that
    bounds a forward's rows.

    ``layout`` may be ``auto`` before it is priced (the pricing times matrix products at the
    model's own shapes, so sizes that fit under no layout are refused first): then the job must
    fit under at least one of ``auto``'s candidates — the first that does is answered, else the
    first candidate's error — and the chosen plan is checked again once it is known.

    ``ranks_here``: ranks sharing this machine (default: ``LOCAL_WORLD_SIZE`` under a launcher
    that sets it, else all ``tp × pp``).
    """
    sizes = dict(tp=tp, pp=pp, dtype_bytes=dtype_bytes, kv_tokens=kv_tokens, kv_cache=kv_cache,
                 prefill_rows=prefill_rows, context=context, logit_rows=logit_rows, rows_option=rows_option,
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
               kv_tokens: int, kv_cache: str, prefill_rows: int, context: int, logit_rows: int | None,
               rows_option: str, ranks_here: int | None, available: int | None) -> int:
    plan = make_plan(arch, rank_config, layout, tp=tp, pp=pp, dtype_bytes=dtype_bytes)
    kv = plan.totals["kv_bytes_per_token"]["latent" if kv_cache == "latent" else "full"]
    acts = activation_bytes(plan.totals, prefill_rows, context, dtype_bytes, logit_rows)
    per_rank = plan.totals["params_per_rank"] * dtype_bytes + kv * kv_tokens + acts
    here = ranks_here or int(os.environ.get("LOCAL_WORLD_SIZE", tp * pp))
    need = per_rank * here
    available = available_bytes() if available is None else available
    if available is not None and need > available:
        raise ValueError(
            f"the model needs about {need / _GIB:.3g} GiB here ({per_rank / _GIB:.3g} GiB of weights, KV "
            f"cache and {acts / _GIB:.3g} GiB of activations in the largest forward per rank × {here} ranks) but "
            f"{available / _GIB:.3g} GiB is available; check the sizes in config.json (hidden_size "
            f"{arch.hidden_size}, intermediate_size {arch.ffn_hidden_size}, {arch.num_layers} layers), "
            f"lower {rows_option} or spread the job over more machines"
        )
    return need
