"""Which slice of a dimension a tensor-parallel rank holds.

Layers receive their tensor-parallel group explicitly (Megatron's ``tp_group`` argument) and
turn it into a ``TPView`` once, at construction. A ``TPView`` without a process group describes
"rank k of n" for single-process tests of the sharding itself; its collectives refuse to run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from deinfer_megatron.arch.model import ModelArch


@dataclass(frozen=True)
class TPView:
    """This rank's position in its tensor-parallel group."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside a group of {self.size}")

    @classmethod
    def of(cls, tp_group: "dist.ProcessGroup | TPView | None") -> "TPView":
        """Accept a process group (or an explicit view) and never fall back to a global one."""
        if isinstance(tp_group, TPView):
            return tp_group
        if tp_group is None:
            raise ValueError(
                "tp_group is required: pass the tensor-parallel process group (for example "
                "megatron.core.parallel_state.get_tensor_model_parallel_group()) or a TPView"
            )
        return cls(dist.get_rank(tp_group), dist.get_world_size(tp_group), tp_group)


@dataclass(frozen=True)
class Span:
    """Rows ``[start, stop)`` of a dimension of size ``full``."""

    full: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)

    @classmethod
    def whole(cls, full: int) -> "Span":
        return cls(full, 0, full)


def balanced_split(n: int, tp: TPView) -> Span:
    """Rows of ``n`` for this rank when ``n`` need not divide evenly (sizes differ by ≤ 1)."""
    return Span(n, n * tp.rank // tp.size, n * (tp.rank + 1) // tp.size)


def unit_split(units: int, unit_size: int, tp: TPView) -> Span:
    """Rows of ``units`` blocks of ``unit_size`` rows (attention heads, or single rows).

    With at least as many units as ranks, the units are split as evenly as possible. With fewer
    (GQA with fewer KV heads than ranks) each unit is replicated on ``size // units`` consecutive
    ranks, which is how the query heads of rank r line up with their KV head.
    """
    if units >= tp.size:
        first, last = units * tp.rank // tp.size, units * (tp.rank + 1) // tp.size
    else:
        if tp.size % units:
            raise ValueError(
                f"{units} heads cannot be replicated evenly over {tp.size} tensor-parallel ranks; "
                f"use a TP size that divides or is a multiple of {units}"
            )
        first = tp.rank // (tp.size // units)
        last = first + 1
    return Span(units * unit_size, first * unit_size, last * unit_size)


def padded_chunk(n: int, size: int) -> int:
    """Per-rank rows when ``n`` rows are padded with zeros up to a multiple of ``size``."""
    return -(-n // size)


def valid_tp_sizes(num_heads: int, num_kv_heads: int, limit: int = 64) -> list[int]:
    """TP sizes that split the query heads evenly and split or replicate the KV heads evenly."""
    out = []
    for t in range(1, limit + 1):
        if num_heads % t:
            continue
        if num_kv_heads % t == 0 or t % num_kv_heads == 0:
            out.append(t)
    return out


def check_parallel_sizes(arch: ModelArch, tp: int, pp: int) -> None:
    """Reject TP/PP sizes ``arch`` cannot be split into, naming the valid ones:
    the one check of a job's sizes, made where the job is validated."""
    valid = valid_tp_sizes(arch.num_heads, arch.num_kv_heads)
    if tp < 1 or pp < 1:
        raise ValueError(f"--tp and --pp must be positive integers, got --tp {tp} --pp {pp}")
    if tp not in valid:
        raise ValueError(
            f"--tp {tp} does not split {arch.num_heads} heads / {arch.num_kv_heads} KV heads evenly; "
            f"valid TP sizes: {', '.join(map(str, valid))}"
        )
    if not 1 <= pp <= arch.num_layers:
        raise ValueError(f"--pp {pp} must be between 1 and the number of layers ({arch.num_layers})")
    if arch.num_layers % pp:
        valid = [p for p in range(1, arch.num_layers + 1) if arch.num_layers % p == 0]
        raise ValueError(f"{arch.num_layers} layers do not split evenly over --pp {pp} (Megatron's stages "
                         f"hold equal numbers of layers); valid PP sizes: {', '.join(map(str, valid))}")
