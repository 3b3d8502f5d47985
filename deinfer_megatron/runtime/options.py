"""How a job's model is placed and run: where its ranks run, its precision, what drives it.

Each is parsed once where it enters (argparse, or a job built in Python) and then passed as a
value: the layout request is a ``LayoutRequest``, the collectives a ``Collectives``, the
precision a ``DType``, the engine an ``Engine``. The JSON a job reports keeps the plain names.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from enum import Enum

import torch

from deinfer_megatron.launch.env import detect
from deinfer_megatron.parallel.collectives import Collectives
from deinfer_megatron.planning.request import LayoutRequest
from deinfer_megatron.specs.layout import Layout

log = logging.getLogger(__name__)


def _parse(enum: type[Enum], value: object, what: str) -> Enum:
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(m.value for m in enum)}") from None


class Engine(str, Enum):
    """What drives the stage: Megatron-Core's own forward, or DeepSpeed-Inference around it
    (``runtime.engines``; generation is then driven through the DeepSpeed engine the same way)."""

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

    @property
    def native(self) -> bool:
        """Whether this machine computes products in this precision with its own instructions.
        bfloat16 needs a CUDA device or a CPU with AVX-512 BF16 or AMX; elsewhere (an AVX2-only
        CPU) oneDNN emulates it and a decode step's GEMMs run several times slower than float32
        (docs/SERVING.md, "bfloat16 on a CPU without bfloat16 instructions"). float32 is native
        everywhere. A torch without these probes is taken at its word (native)."""
        if self is not DType.BFLOAT16 or torch.cuda.is_available():
            return True
        probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        return any(p is None for p in probes) or any(p() for p in probes)


@functools.cache
def warn_if_emulated(dtype: DType) -> None:
    """One warning line where ``dtype`` is not ``native`` here, at most once per process (bench
    checks a job per cell) and from one process of a job (the command, or a launcher's rank 0,
    since under a launcher every rank runs the command): such a run is valid and computes the
    same values, only slowly."""
    launched = detect()
    if not dtype.native and (launched is None or launched.rank == 0):
        log.warning("--dtype %s: this CPU has no %s instructions (AVX-512 BF16 or AMX), so its products are "
                    "emulated and run several times slower than float32; --dtype float32 is faster here",
                    dtype.value, dtype.value)


@dataclass(frozen=True)
class Parallelism:
    """Tensor- and pipeline-parallel sizes, the layout asked for, and what carries the
    tensor-parallel collectives (``parallel.collectives``: shared memory between the CPU ranks of
    a node by default).

    ``layout`` and ``collectives`` are parsed on construction (``LayoutRequest.parse``,
    ``Collectives.parse``), so a job built in Python may name them (``layout="auto"``).
    """

    tp: int = 1
    pp: int = 1
    layout: LayoutRequest = LayoutRequest(Layout.DEINFER)  # the commands' own defaults are their flags'
    collectives: Collectives = Collectives.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", LayoutRequest.parse(self.layout))
        object.__setattr__(self, "collectives", Collectives.parse(self.collectives))

    @property
    def world(self) -> int:
        """Ranks the job needs."""
        return self.tp * self.pp
