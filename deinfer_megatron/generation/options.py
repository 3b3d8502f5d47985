"""The typed pieces a generation job is made of: where it runs, what it caches, who drives it.

Each is parsed once where it enters (argparse, or a job built in Python) and then passed as a
value, so the code below never compares strings: the layout is a ``Layout``, the KV cache a
``CacheKind`` (the only place an unknown cache name is refused is ``CacheKind.parse``), the
engine an ``Engine``, the precision a ``DType``. The JSON a job reports keeps the plain names
(``.value``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch

from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.parallel.collectives import Collectives
from deinfer_megatron.specs.layout import Layout, LayoutPlan, parse_layout_option


def _parse(enum: type[Enum], value: object, what: str) -> Enum:
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(m.value for m in enum)}") from None


class Engine(str, Enum):
    """What drives generation: Megatron-Core's static engine, or DeepSpeed-Inference around the
    stage (generation is then driven through the DeepSpeed engine the same way)."""

    MEGATRON = "megatron"
    DEEPSPEED = "deepspeed"

    @classmethod
    def parse(cls, value: "str | Engine") -> "Engine":
        return _parse(cls, value, "engine")  # type: ignore[return-value]


class DType(str, Enum):
    """The precision the weights are loaded and run in."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @classmethod
    def parse(cls, value: "str | DType") -> "DType":
        return _parse(cls, value, "dtype")  # type: ignore[return-value]

    @property
    def torch(self) -> torch.dtype:
        return getattr(torch, self.value)

    @property
    def itemsize(self) -> int:
        return self.torch.itemsize


def latent_cache_layouts() -> str:
    """The layouts that can keep the latent cache, as a user reads them (``deinfer``): asked of
    ``Layout.supports_latent_cache``, so that the rule lives with the layout table."""
    return " or ".join(layout.value for layout in Layout if layout.supports_latent_cache)


@dataclass(frozen=True)
class Parallelism:
    """Tensor- and pipeline-parallel sizes, the layout the stages are built in, and what carries
    the tensor-parallel collectives (``parallel.collectives``: shared memory between the CPU
    ranks of a node by default).

    ``layout`` and ``collectives`` are parsed on construction (``parse_layout_option``,
    ``Collectives.parse``; a member passes unchanged), so a job built in Python may name them.
    ``layout`` may be ``"auto"`` (resolved into a ``LayoutPlan`` by the job before the ranks
    start) or such a plan.
    """

    tp: int = 1
    pp: int = 1
    layout: Layout | LayoutPlan | str = Layout.DEINFER
    collectives: Collectives = Collectives.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", parse_layout_option(self.layout))
        object.__setattr__(self, "collectives", Collectives.parse(self.collectives))

    @property
    def world(self) -> int:
        """Ranks the job needs."""
        return self.tp * self.pp


@dataclass(frozen=True)
class CacheOptions:
    """Which KV cache the decomposed layers keep, and how large it may be.

    Args:
        kind: full K/V of each rank's heads, or the rank-r latents (parsed by ``CacheKind.parse``).
        absorb_values: with the latent cache, fold ``U_v`` in after attention when decoding.
        budget_gb: KV-cache memory per rank that sizes the slots; None: what the request needs.
    """

    kind: CacheKind = CacheKind.FULL
    absorb_values: bool = True
    budget_gb: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CacheKind.parse(self.kind))

    def check_budget(self) -> None:
        """A budget must be a positive number of GB (NaN and infinity included in the refusal)."""
        if self.budget_gb is not None and not (math.isfinite(self.budget_gb) and self.budget_gb > 0):
            raise ValueError(f"--kv-budget-gb must be a number of GB > 0, got {self.budget_gb}")
