"""Every tensor-parallel collective the project issues, and the ledger that counts them.

Layers never call ``torch.distributed`` themselves: they call the named operations below, so
this module is the one place where communication happens and is counted. Counting is opt-in
(``with recording() as ledger:``) and costs one ``ContextVar`` lookup per collective when off.

A collective is recorded as its *element count per token*: for an all-gather, the width of the
gathered result; for an all-reduce, the width of the reduced tensor. That is the unit DESIGN.md
uses for its formulas, and what ``deinfer-megatron plan`` predicts.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch
import torch.distributed as dist

from deinfer_megatron.parallel.topology import TPView


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class CommRecord:
    """One collective as issued by one rank."""

    kind: str  # "all_gather" | "all_reduce"
    site: str  # "<layer number>.<module>", e.g. "3.linear_qkv_down"
    layer: int  # Megatron layer number (1-based, global); 0 outside transformer layers
    elements_per_token: int
    tokens: int


@dataclass
class CommLedger:
    """Collectives recorded while a ``recording()`` block was active."""

    records: list[CommRecord] = field(default_factory=list)

    def by_layer(self) -> dict[int, list[CommRecord]]:
        out: dict[int, list[CommRecord]] = {}
        for rec in self.records:
            out.setdefault(rec.layer, []).append(rec)
        return out

    def kinds(self, layer: int) -> Counter[str]:
        return Counter(r.kind for r in self.records if r.layer == layer)

    def elements_per_token(self, layer: int) -> int:
        return sum(r.elements_per_token for r in self.records if r.layer == layer)

    def clear(self) -> None:
        self.records.clear()


_ACTIVE: contextvars.ContextVar[CommLedger | None] = contextvars.ContextVar(
    "deinfer_comm_ledger", default=None
)


@contextlib.contextmanager
def recording(ledger: CommLedger | None = None) -> Iterator[CommLedger]:
    """Record every collective issued inside the block into ``ledger`` (a new one by default)."""
    ledger = ledger if ledger is not None else CommLedger()
    token = _ACTIVE.set(ledger)
    try:
        yield ledger
    finally:
        _ACTIVE.reset(token)


def _record(kind: str, site: str, layer: int, width: int, x: torch.Tensor) -> None:
    ledger = _ACTIVE.get()
    if ledger is not None:
        tokens = x.numel() // max(x.shape[-1], 1)
        ledger.records.append(CommRecord(kind, site, layer, width, tokens))


# ------------------------------------------------------------------ transports
# How a group's raw all-reduce / all-gather travel. Chosen once per group at setup
# (``parallel.collectives.install``, from ``runtime.init_parallel``); a group without an entry uses
# torch.distributed. Ledger accounting above is the same whichever carries the bytes.


class Transport(Protocol):
    """Carries the raw collectives of one tensor-parallel group (e.g. ``shm.ShmCollectives``)."""

    def all_reduce(self, x: torch.Tensor) -> None: ...  # in-place sum, contiguous x

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> None: ...  # out = [size*x.shape[0], ...]


_TRANSPORTS: dict[dist.ProcessGroup, Transport] = {}


def use_transport(group: dist.ProcessGroup, transport: Transport | None) -> None:
    """Route ``group``'s all-reduces and all-gathers through ``transport`` (None: torch.distributed)."""
    if transport is None:
        _TRANSPORTS.pop(group, None)
    else:
        _TRANSPORTS[group] = transport


def _raw_all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> None:
    transport = _TRANSPORTS.get(group)
    if transport is None:
        dist.all_reduce(x, group=group)
    else:
        transport.all_reduce(x)


def _raw_all_gather(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup) -> None:
    transport = _TRANSPORTS.get(group)
    if transport is None:
        _all_gather_flat(out, x, group=group)
    else:
        transport.all_gather(out, x)


def _require_group(tp: TPView, op: str, site: str) -> dist.ProcessGroup:
    if tp.group is None:
        raise RuntimeError(
            f"{site}: {op} over {tp.size} tensor-parallel ranks needs a process group; this layer "
            "was built as a single-process shard view (TPView without a group)"
        )
    return tp.group


def all_gather_last_dim(x: torch.Tensor, tp: TPView, *, site: str, layer: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension, in rank order.

    Args:
        x: ``[..., c]`` local chunk, the same shape on every rank.
    Returns:
        ``[..., tp.size * c]`` on every rank.
    """
    if tp.size == 1:
        return x
    group = _require_group(tp, "all-gather", site)
    x = x.contiguous()
    out = torch.empty((tp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _raw_all_gather(out, x, group)
    _record("all_gather", site, layer, tp.size * x.shape[-1], x)
    chunks = out.view(tp.size, *x.shape)
    return chunks.movedim(0, -2).reshape(*x.shape[:-1], tp.size * x.shape[-1])


def all_reduce_sum(x: torch.Tensor, tp: TPView, *, site: str, layer: int) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place when possible) and return it."""
    if tp.size == 1:
        return x
    group = _require_group(tp, "all-reduce", site)
    x = x.contiguous()
    _raw_all_reduce(x, group)
    _record("all_reduce", site, layer, x.shape[-1], x)
    return x


# ------------------------------------------------------------------ between pipeline stages
# Point-to-point transfers of whole activations and a broadcast of sampled tokens: they move
# between stages, not within a tensor-parallel group, and are not what the planner counts, so
# they are not recorded in the ledger.


def send_to(x: torch.Tensor, dst: int) -> None:
    """Send ``x`` to global rank ``dst`` (the next pipeline stage)."""
    dist.send(x.contiguous(), dst=dst)


def recv_from(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
    """Receive a tensor of ``shape`` from global rank ``src`` (the previous pipeline stage)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out, src=src)
    return out


def broadcast_from(x: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank of ``group`` gets global rank ``src``'s ``x`` (same shape and dtype)."""
    x = x.contiguous()
    dist.broadcast(x, src=src, group=group)
    return x


def max_over_world(x: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of ``x`` over every rank of the job (bookkeeping, e.g. the largest
    KV cache any rank holds); not a model collective, not recorded."""
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def barrier(tp: TPView) -> None:
    """Wait until every rank of the tensor-parallel group arrives (timing, not model maths)."""
    if tp.size > 1:
        dist.barrier(group=_require_group(tp, "barrier", "barrier"))
