"""Every tensor-parallel collective the project issues, and the ledger that counts them.

Layers never call ``torch.distributed`` themselves: they call the named operations below, so
this module is the one place where communication happens and is counted. Counting is opt-in
(``with recording() as ledger:``) and costs one ``ContextVar`` lookup per collective when off;
so is timing (``with timing() as times:``: the entry and exit instant of every raw all-reduce and
all-gather, which ``bench --profile`` lines up across the ranks of one host).

A collective is recorded as its *element count per token*: for an all-gather, the width of the
gathered result; for an all-reduce, the width of the reduced tensor; for a reduce-scatter, the
width of the tensor before it is scattered. That is the unit DESIGN.md uses for its formulas, and
what ``deinfer-megatron plan`` predicts.

Training: every model collective is an autograd function whose backward is its adjoint, as in
Megatron's ``tensor_parallel/mappings.py`` (DESIGN.md §3, "Training the factors"):

  ====================================  ============================================
  forward                               backward (of the gradient)
  ====================================  ============================================
  ``all_gather_last_dim``               reduce-scatter (``grad="reduce_scatter"``, the
                                        gathered result feeds rank-specific work) or
                                        this rank's slice (``grad="split"``, it feeds
                                        replicated work, so every rank's gradient is
                                        already whole)
  ``all_reduce_sum``                    identity
  ``copy_to_tp`` (identity)             all-reduce: the input is replicated and feeds
                                        rank-split weights, each rank holds a part of
                                        its gradient
  ====================================  ============================================

Backward collectives are recorded too, with ``phase="backward"`` (forward ones have
``phase="forward"``); ``kinds``/``elements_per_token`` count the forward phase unless asked.
Without autograd (``torch.no_grad``/``inference_mode``, or an input that needs no gradient) the
functions run the plain collective: inference pays no autograd bookkeeping.

``sum_weight_grad_over_tp`` is the one collective on weights rather than activations: a
parameter slice held by several ranks (KV heads replicated when there are fewer than TP ranks)
gets the sum of its replicas' gradients. It is recorded with ``phase="weight_grad"``.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch
import torch.distributed as dist

from deinfer_megatron.parallel.topology import TPView


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

PHASES = ("forward", "backward", "weight_grad")


@dataclass(frozen=True)
class CommRecord:
    """One collective as issued by one rank."""

    kind: str  # "all_gather" | "all_reduce" | "reduce_scatter"
    site: str  # "<layer number>.<module>", e.g. "3.linear_qkv_down"
    layer: int  # Megatron layer number (1-based, global); 0 outside transformer layers
    elements_per_token: int  # for phase "weight_grad": elements of the whole reduced tensor
    tokens: int  # for phase "weight_grad": 1
    phase: str = "forward"  # "forward" | "backward" (of activations) | "weight_grad"


@dataclass
class CommLedger:
    """Collectives recorded while a ``recording()`` block was active."""

    records: list[CommRecord] = field(default_factory=list)

    def by_layer(self) -> dict[int, list[CommRecord]]:
        out: dict[int, list[CommRecord]] = {}
        for rec in self.records:
            out.setdefault(rec.layer, []).append(rec)
        return out

    def kinds(self, layer: int, phase: str = "forward") -> Counter[str]:
        return Counter(r.kind for r in self.records if r.layer == layer and r.phase == phase)

    def elements_per_token(self, layer: int, phase: str = "forward") -> int:
        return sum(r.elements_per_token for r in self.records
                   if r.layer == layer and r.phase == phase)

    def phase(self, phase: str) -> list[CommRecord]:
        """The records of one phase (``PHASES``), in the order they were issued."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; choose one of {', '.join(PHASES)}")
        return [r for r in self.records if r.phase == phase]

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


def _record(kind: str, site: str, layer: int, width: int, x: torch.Tensor,
            phase: str = "forward", ledger: CommLedger | None = None) -> None:
    ledger = ledger if ledger is not None else _ACTIVE.get()
    if ledger is not None:
        tokens = x.numel() // max(x.shape[-1], 1)
        ledger.records.append(CommRecord(kind, site, layer, width, tokens, phase))


@dataclass
class CommTimes:
    """``(kind, entered, left)`` of every raw collective issued while ``timing()`` was on, in
    ``time.perf_counter`` seconds (CLOCK_MONOTONIC: comparable between processes of one host)."""

    spans: list[tuple[str, float, float]] = field(default_factory=list)


_TIMES: contextvars.ContextVar[CommTimes | None] = contextvars.ContextVar("deinfer_comm_times", default=None)


@contextlib.contextmanager
def timing(times: CommTimes | None = None) -> Iterator[CommTimes]:
    """Time every raw all-reduce and all-gather issued inside the block into ``times``."""
    times = times if times is not None else CommTimes()
    token = _TIMES.set(times)
    try:
        yield times
    finally:
        _TIMES.reset(token)


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


def transport_of(group: dist.ProcessGroup) -> Transport | None:
    """What carries ``group``'s all-reduces and all-gathers (None: torch.distributed itself)."""
    return _TRANSPORTS.get(group)


def _raw_all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> None:
    times = _TIMES.get()
    entered = time.perf_counter() if times is not None else 0.0
    transport = _TRANSPORTS.get(group)
    if transport is None:
        dist.all_reduce(x, group=group)
    else:
        transport.all_reduce(x)
    if times is not None:
        times.spans.append(("all_reduce", entered, time.perf_counter()))


def _raw_all_gather(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup) -> None:
    times = _TIMES.get()
    entered = time.perf_counter() if times is not None else 0.0
    transport = _TRANSPORTS.get(group)
    if transport is None:
        _all_gather_flat(out, x, group=group)
    else:
        transport.all_gather(out, x)
    if times is not None:
        times.spans.append(("all_gather", entered, time.perf_counter()))


def _require_group(tp: TPView, op: str, site: str) -> dist.ProcessGroup:
    if tp.group is None:
        raise RuntimeError(
            f"{site}: {op} over {tp.size} tensor-parallel ranks needs a process group; this layer "
            "was built as a single-process shard view (TPView without a group)"
        )
    return tp.group


def _needs_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def _gather(x: torch.Tensor, tp: TPView, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((tp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _raw_all_gather(out, x, group)
    chunks = out.view(tp.size, *x.shape)
    return chunks.movedim(0, -2).reshape(*x.shape[:-1], tp.size * x.shape[-1])


def _reduce_scatter(g: torch.Tensor, tp: TPView, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``g [..., t·c]`` over the ranks and keep this rank's ``[..., c]`` (the adjoint of
    ``_gather``): the chunks move to the front so each rank's slice is contiguous."""
    c = g.shape[-1] // tp.size
    chunks = g.reshape(*g.shape[:-1], tp.size, c).movedim(-2, 0).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=g.dtype, device=g.device)
    _reduce_scatter_flat(out, chunks.view(-1, *out.shape[1:]), group=group)
    return out


def _sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    _raw_all_reduce(x, group)
    return x


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPView, group: dist.ProcessGroup, site: str,
                layer: int, grad: str, ledger: CommLedger | None) -> torch.Tensor:
        ctx.tp, ctx.group, ctx.site, ctx.layer, ctx.grad, ctx.ledger = tp, group, site, layer, grad, ledger
        return _gather(x, tp, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tp = ctx.tp
        if ctx.grad == "split":
            c = g.shape[-1] // tp.size
            return g[..., tp.rank * c : (tp.rank + 1) * c].contiguous(), None, None, None, None, None, None
        out = _reduce_scatter(g, tp, ctx.group)
        _record("reduce_scatter", ctx.site, ctx.layer, g.shape[-1], g, "backward", ctx.ledger)
        return out, None, None, None, None, None, None


class _SumOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return _sum(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return g, None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPView, site: str, layer: int,
                ledger: CommLedger | None) -> torch.Tensor:
        ctx.tp, ctx.site, ctx.layer, ctx.ledger = tp, site, layer, ledger
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = _sum(g.clone(), _require_group(ctx.tp, "backward all-reduce", ctx.site))
        _record("all_reduce", ctx.site, ctx.layer, g.shape[-1], g, "backward", ctx.ledger)
        return out, None, None, None, None


class _SumGradOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, tp: TPView, scatter: Any, site: str,
                layer: int, ledger: CommLedger | None) -> torch.Tensor:
        ctx.tp, ctx.scatter, ctx.site, ctx.layer, ctx.ledger = tp, scatter, site, layer, ledger
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        place, take = ctx.scatter
        full = _sum(place(g), _require_group(ctx.tp, "weight-gradient all-reduce", ctx.site))
        _record("all_reduce", ctx.site, ctx.layer, full.numel(), full.reshape(1, -1), "weight_grad",
                ctx.ledger)
        return take(full), None, None, None, None, None


def all_gather_last_dim(x: torch.Tensor, tp: TPView, *, site: str, layer: int,
                        grad: str = "reduce_scatter") -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension, in rank order.

    Args:
        x: ``[..., c]`` local chunk, the same shape on every rank.
        grad: the backward: ``"reduce_scatter"`` when the gathered tensor feeds rank-specific
            work (each rank's gradient of it is a partial sum), ``"split"`` when it feeds
            replicated work (every rank already holds the whole gradient).
    Returns:
        ``[..., tp.size * c]`` on every rank.
    """
    if grad not in ("reduce_scatter", "split"):
        raise ValueError(f"{site}: grad must be 'reduce_scatter' or 'split', got {grad!r}")
    if tp.size == 1:
        return x
    group = _require_group(tp, "all-gather", site)
    _record("all_gather", site, layer, tp.size * x.shape[-1], x)
    if not _needs_grad(x):
        return _gather(x, tp, group)
    return _GatherLastDim.apply(x, tp, group, site, layer, grad, _ACTIVE.get())


def all_reduce_sum(x: torch.Tensor, tp: TPView, *, site: str, layer: int) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks and return it (in place when no gradient is
    needed). Backward: identity — the sum's gradient is the same on every rank and each
    partial input gets all of it."""
    if tp.size == 1:
        return x
    group = _require_group(tp, "all-reduce", site)
    _record("all_reduce", site, layer, x.shape[-1], x)
    if not _needs_grad(x):
        return _sum(x, group)
    return _SumOverTP.apply(x, group)


def copy_to_tp(x: torch.Tensor, tp: TPView, *, site: str, layer: int) -> torch.Tensor:
    """Identity in the forward pass; the gradient is summed over the tensor-parallel ranks.

    Called on a replicated input before rank-split weights read it (Megatron's
    ``copy_to_tensor_model_parallel_region``): each rank's weights contribute a part of the
    input's gradient, and upstream replicated work needs all of it. Nothing is issued (or
    recorded) in the forward pass, nor when no gradient flows; a view without a process group
    (single-process shard tests) runs the forward and refuses only the backward.
    """
    if tp.size == 1 or not _needs_grad(x):
        return x
    return _CopyToTP.apply(x, tp, site, layer, _ACTIVE.get())


def sum_weight_grad_over_tp(w: torch.Tensor, tp: TPView, place: Any, take: Any, *, site: str,
                            layer: int) -> torch.Tensor:
    """Identity on a weight ``w`` whose gradient is summed over the ranks that hold the same
    slice (replicas), for use in forward: ``y = x @ sum_weight_grad_over_tp(w, ...)``.

    Args:
        place: ``g -> full`` puts this rank's gradient into a zero tensor laid out for the whole
            group (one slot per distinct slice, replicas in the same slot).
        take: ``full -> g`` reads this rank's slot back.
    One all-reduce of the whole tensor per backward; none without autograd or at TP 1.
    """
    if tp.size == 1 or not _needs_grad(w):
        return w
    return _SumGradOverTP.apply(w, tp, (place, take), site, layer, _ACTIVE.get())


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


def sum_over_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over every rank of ``group`` (training bookkeeping across stages: the global
    gradient norm, the two copies of tied embeddings); not a TP model collective, not recorded."""
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def barrier(tp: TPView) -> None:
    """Wait until every rank of the tensor-parallel group arrives (timing, not model maths)."""
    if tp.size > 1:
        dist.barrier(group=_require_group(tp, "barrier", "barrier"))


def broadcast_bytes(payload: bytes | None, src: int, device: torch.device) -> bytes:
    """Every rank of the job gets global rank ``src``'s ``payload`` (a step's description from
    the server's scheduler): its length, then its bytes. Control data, not recorded. A job of
    one rank has nobody to send to: the payload is returned as is."""
    if dist.get_world_size() == 1:
        assert payload is not None, "the only rank is the source"
        return payload
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.long, device=device)
    dist.broadcast(size, src=src)
    if dist.get_rank() == src:
        assert payload is not None, "the source rank sends a payload"
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src)
    return payload if payload is not None else bytes(data.cpu().numpy().tobytes())


def gather_bytes(payload: bytes, device: torch.device) -> list[bytes]:
    """Every rank's ``payload``, by global rank, on every rank (what each rank measured, for the
    one that reports): the lengths, then the bytes padded to the longest. Control data, not
    recorded."""
    world = dist.get_world_size()
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    data = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    out = [torch.empty_like(data) for _ in range(world)]
    dist.all_gather(out, data)
    return [bytes(o[:n].cpu().numpy().tobytes()) for o, n in zip(out, lengths)]


def world_barrier(device: torch.device) -> None:
    """Wait until every rank of the job arrives (a checkpoint's files are complete); not a
    model collective, not recorded."""
    if dist.get_world_size() > 1:
        flag = torch.zeros(1, device=device)
        dist.all_reduce(flag)
