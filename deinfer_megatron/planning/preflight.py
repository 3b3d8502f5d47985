"""Will the job fit in memory? Answered from the plan, before a single tensor is allocated.

A config.json with a wrong size (``hidden_size`` 10⁹, say) would otherwise surface as an
allocator failure — or the kernel's OOM killer — deep inside a rank. The planner already knows
the parameters each rank holds, the KV bytes per token and the activations per token row of its
widest layer; against the memory this machine has available (``MemAvailable``, or the cgroup's
limit when lower) that is a one-line refusal.

The activations are those of the largest forward, the prefill's (``prefill_rows`` token rows,
at most ``--max-prefill-tokens``: ``generation.prefill``). The planner's count is a lower bound
(outputs of the products, residual stream and norm); a rank's peak RSS grows by about
``ACTIVATION_FACTOR`` times it per row (copies for RoPE and the attention layout, the
allocator's slack; docs/INFERENCE.md has the measurement). Scores a core materialises
(Megatron's attention) are counted at their size, ``rows × heads × context`` twice.
Logits are counted apart (``plan.logit_elements``), as the vocabulary is the model's widest
dimension (SmolLM2: 49,152 against a hidden size of 576): for every row of a perplexity pass,
for the last row of each sequence in generation (Megatron's static context keeps only those).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.launch.env import detect
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.specs.layout import Layout, LayoutPlan
from deinfer_megatron.specs.rank_config import RankConfig

_GIB = 2**30
ACTIVATION_FACTOR = 3.5  # peak RSS per prefill row ÷ the planner's activation count, measured, rounded up


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


def ranks_on_this_machine(world: int) -> int:
    """Ranks of a ``world``-rank job sharing this machine: what its launcher says (torchrun's
    and Slurm's tasks per node, ``launch.env``), else all of them (ranks this command spawns)."""
    launched = detect()
    if launched is not None and launched.local_world_size:
        return launched.local_world_size
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


@dataclass(frozen=True)
class Footprint:
    """What a job holds besides the weights: its KV cache and the largest forward.

    Args:
        kv_tokens: KV-cache tokens of every slot together.
        kv_cache: ``full`` or ``latent`` (the planner's KV bytes per token of that kind).
        prefill_rows: token rows of the largest forward; ``context``: the keys each attends to.
        logit_rows: rows whose vocabulary-wide logits that forward returns (None: every row).
        rows_option: the command's option that bounds a forward's rows, named in a refusal.
    """

    kv_tokens: int = 0
    kv_cache: CacheKind = CacheKind.FULL
    prefill_rows: int = 0
    context: int = 0
    logit_rows: int | None = None
    rows_option: str = "--max-prefill-tokens"


@dataclass(frozen=True)
class MemoryBudget:
    """Whether a job's plan fits this machine: weights + KV cache + the largest forward's
    activations per rank, times the ranks sharing the machine, against what it has available.

    ``ranks_here``: ranks sharing this machine (default: ``ranks_on_this_machine``);
    ``available``: bytes (default: what the machine has when asked, ``available_bytes``)."""

    arch: ModelArch
    rank_config: RankConfig
    tp: int
    pp: int
    dtype_bytes: int
    footprint: Footprint = Footprint()
    ranks_here: int | None = None
    available: int | None = None

    def need(self, layout: Layout | LayoutPlan) -> tuple[int, int, int, int]:
        """(bytes on this machine, bytes per rank, activation bytes per rank, ranks here) of
        ``layout``; ValueError where the planner cannot lay the model out so (a dense block TP
        cannot split)."""
        f = self.footprint
        plan = make_plan(self.arch, self.rank_config, layout, tp=self.tp, pp=self.pp, dtype_bytes=self.dtype_bytes)
        kv = plan.totals["kv_bytes_per_token"][CacheKind.parse(f.kv_cache).value]
        acts = activation_bytes(plan.totals, f.prefill_rows, f.context, self.dtype_bytes, f.logit_rows)
        per_rank = plan.totals["params_per_rank"] * self.dtype_bytes + kv * f.kv_tokens + acts
        here = self.ranks_here or ranks_on_this_machine(self.tp * self.pp)
        return per_rank * here, per_rank, acts, here

    def fits(self, layout: Layout | LayoutPlan) -> bool:
        """Whether ``check`` accepts ``layout`` (``--layout auto`` chooses among those that do)."""
        try:
            self.check(layout)
        except ValueError:
            return False
        return True

    def check(self, layout: Layout | LayoutPlan) -> int:
        """Bytes the ranks on this machine need for ``layout``; ValueError when more than is
        available, naming the sizes to check and the option that bounds a forward's rows."""
        need, per_rank, acts, here = self.need(layout)
        available = available_bytes() if self.available is None else self.available
        if available is not None and need > available:
            a = self.arch
            raise ValueError(
                f"the model needs about {need / _GIB:.3g} GiB here ({per_rank / _GIB:.3g} GiB of weights, KV "
                f"cache and {acts / _GIB:.3g} GiB of activations in the largest forward per rank × {here} ranks) but "
                f"{available / _GIB:.3g} GiB is available; check the sizes in config.json (hidden_size "
                f"{a.hidden_size}, intermediate_size {a.ffn_hidden_size}, {a.num_layers} layers), "
                f"lower {self.footprint.rows_option} or spread the job over more machines"
            )
        return need
