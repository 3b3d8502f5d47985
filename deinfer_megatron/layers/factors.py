"""The factors of a decomposed matrix ``W ≈ U·V``, one module per way of sharding a factor.

``V`` (r × in) is a *down* factor: it maps the input to the rank-r latent. ``U`` (out × r) is an
*up* factor: it maps the latent to the output. A decomposed block may merge several matrices
that read the same input ("sections": q, k, v; or gate, up) into one down factor, so a down
factor takes the tuple of its section ranks and returns one latent per section.

Weights are stored input-major — ``Vᵀ`` as ``(in, r)``, ``Uᵀ`` as ``(sections, r, out)`` — and
applied as ``x @ W``: for the few rows of a decode step, CPU BLAS runs a GEMM faster from a
row-major ``(in, out)`` operand than from Megatron's ``(out, in)`` (docs/ARCHITECTURE.md), and
large prefill GEMMs are no slower. Checkpoints keep the usual ``U``/``V`` orientation; loaders
transpose.

Each module allocates only its local shard and knows how to fill it: ``loader_for(name)``
returns a ``weight_loader(param, source, shard_id)`` where ``source`` is the *full* (unsharded)
tensor of one Hugging Face matrix — a ``torch.Tensor`` or a lazily-read safetensors slice — and
the loader reads just the rows/columns this rank holds. ``shard_id`` is the section index.

Each class also answers, from its constructor arguments and a ``TPView`` alone, what it costs
one rank (``cost(...)``: parameters held, collectives issued per token): the allocation, the
loaders and the cost read the same split rules below, so the planner never re-derives them.

With ``config.perform_initialization`` a factor initialises itself the way Megatron's CPU
initialisation does: it draws each section's *full* factor (float32, in checkpoint
orientation) with ``init_method`` from the default generator and hands it to its own loader,
so every TP size holds slices of the same full factors for the same seed. Biases start at zero.

Down factors (input ``[..., in]`` or this rank's input slice):
  * ``GatheredDown``  — DeInfer column side: merged V rows split over ranks (zero-padded to a
    multiple of TP), one all-gather of Σr; every rank then holds every full latent.
  * ``ShardedDown``   — naive: each section's rows split over ranks, no communication; the
    latents stay partial (this rank's r/t slice).
  * ``ReducedDown``   — DeInfer row side: V's input columns split like the input, one
    all-reduce of r; every rank then holds the full latent.
Up factors (weights ``(sections, cols, rows)``, i.e. ``Uᵀ``; biases ``(sections, rows)``):
  * ``ShardedUp``     — DeInfer column side: rows split by units (heads or single rows); no
    communication; sections run as one batched GEMM.
  * ``ReducedUp``     — naive: columns split like ``ShardedDown``; all-reduce of the full output
    per section; bias added once after the reduction.
  * ``ReplicatedUp``  — DeInfer row side: the whole U on every rank, bias added once.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deinfer_megatron.layers.costs import Collective, Cost, Gemm, issued, numel
from deinfer_megatron.layers.factor_base import (
    Factor,
    InitMethod,
    check_shape,
    local_param,
    read_block,
    section_ranks_of,
)
from deinfer_megatron.parallel import comm
from deinfer_megatron.parallel.topology import Span, TPView, balanced_split, padded_chunk, unit_split

__all__ = ["GatheredDown", "ShardedDown", "ReducedDown", "ShardedUp", "ReducedUp", "ReplicatedUp",
           "DownFactor", "UpFactor", "read_block"]  # read_block: the checkpoint loaders read sources with it too


# --------------------------------------------------------------------------------------- down


class _Down(Factor):
    """A down factor ``Vᵀ`` (in, cols) over one or more sections sharing one input.

    Subclasses say which input rows this rank reads (``_input_span``), how many columns it
    holds (``_local_columns``) and what it communicates (``_collectives``); allocation and
    ``cost`` both read them.

    Args:
        input_size: the full input width (``in`` of every section's V).
        section_ranks: one rank per section (q, k, v merged; gate, up merged; or one).
        config: Megatron ``TransformerConfig`` (``params_dtype``, ``perform_initialization``).
        tp_group: the tensor-parallel process group, or a ``TPView`` for single-process tests.
        init_method: initialiser of the full V (``Factor._initialise``).
        input_span: this rank's slice of the input (row-parallel classes); whole when None
            unless the class says otherwise.
        layer_number, prefix: where the factor sits, for the ledger and for errors.
    """

    def __init__(
        self,
        input_size: int,
        section_ranks: Sequence[int],
        *,
        config: Any,
        tp_group: Any,
        init_method: InitMethod | None = None,
        input_span: Span | None = None,
        layer_number: int = 0,
        prefix: str = "",
    ) -> None:
        super().__init__(tp_group, layer_number, prefix)
        self.section_ranks = section_ranks_of(section_ranks)
        self.input_size = input_size
        self.input_span = self._input_span(input_size, self.section_ranks, self.tp, input_span, prefix)
        cols = self._local_columns(self.section_ranks, self.tp)
        dim, stride = self._partition(self.section_ranks)
        self.weight = local_param((self.input_span.size, cols), config.params_dtype,  # Vᵀ
                                  partition_dim=dim, stride=stride)
        self._initialise(config, init_method)

    @classmethod
    def cost(cls, input_size: int, section_ranks: Sequence[int], *, tp: TPView,
             input_span: Span | None = None, prefix: str = "") -> Cost:
        """Parameters rank ``tp.rank`` holds and the collectives it issues per token, in the
        forward pass and in the backward pass (of the activations)."""
        ranks = section_ranks_of(section_ranks)
        span = cls._input_span(input_size, ranks, tp, input_span, prefix)
        cols = cls._local_columns(ranks, tp)
        return Cost(span.size * cols, cls._collectives(ranks, tp),
                    backward=cls._backward_collectives(span.size, ranks, tp), gemms=(Gemm(span.size, cols),))

    @classmethod
    def _partition(cls, section_ranks: tuple[int, ...]) -> tuple[int, int]:
        """(split dimension, stride) of the stored ``Vᵀ`` (in, cols): the columns by default."""
        return 1, 1

    @classmethod
    def _backward_collectives(cls, input_width: int, section_ranks: tuple[int, ...],
                              tp: TPView) -> tuple[Collective, ...]:
        """What the backward pass issues per token, listed in the forward order of the
        operations they are the adjoints of (the backward pass issues them in reverse)."""
        return ()

    @classmethod
    def _input_span(cls, input_size: int, section_ranks: tuple[int, ...], tp: TPView,
                    input_span: Span | None, prefix: str) -> Span:
        return input_span or Span.whole(input_size)

    @classmethod
    def _local_columns(cls, section_ranks: tuple[int, ...], tp: TPView) -> int:
        raise NotImplementedError

    @classmethod
    def _collectives(cls, section_ranks: tuple[int, ...], tp: TPView) -> tuple[Collective, ...]:
        return ()

    def _source_shape(self, shard_id: int) -> tuple[int, int]:
        return (self.section_ranks[shard_id], self.input_size)


class GatheredDown(_Down):
    """Merged ``V = [V_0; V_1; ...]`` (Σr × in), rows split evenly after zero-padding to a
    multiple of TP. Rank i holds padded rows ``[i·c, (i+1)·c)``; one all-gather of ``t·c``
    elements per token rebuilds every section's full latent on every rank.

    Shapes: in ``[..., in]`` → out tuple of ``[..., r_s]`` (full latents).
    """

    full_latents = True  # every rank holds whole latents: they can be cached and re-expanded

    @classmethod
    def _local_columns(cls, section_ranks: tuple[int, ...], tp: TPView) -> int:
        return padded_chunk(sum(section_ranks), tp.size)

    @classmethod
    def _collectives(cls, section_ranks: tuple[int, ...], tp: TPView) -> tuple[Collective, ...]:
        return issued(tp, Collective("all_gather", tp.size * cls._local_columns(section_ranks, tp)))

    @classmethod
    def _backward_collectives(cls, input_width: int, section_ranks: tuple[int, ...],
                              tp: TPView) -> tuple[Collective, ...]:
        # in the forward order of what they are adjoints of: the input's copy, the gather
        width = tp.size * cls._local_columns(section_ranks, tp)
        return issued(tp, Collective("all_reduce", input_width), Collective("reduce_scatter", width))

    @property
    def chunk(self) -> int:
        """Padded rows of the merged V on each rank."""
        return self._local_columns(self.section_ranks, self.tp)

    def _load_weight(self, param: nn.Parameter, source: Any, shard_id: int) -> None:
        rank = self.section_ranks[shard_id]
        check_shape(source, self._source_shape(shard_id), self.prefix, f"V of section {shard_id}")
        offset = sum(self.section_ranks[:shard_id])
        chunk = self.chunk
        lo, hi = self.tp.rank * chunk, (self.tp.rank + 1) * chunk
        a, b = max(lo, offset), min(hi, offset + rank)
        if a < b:
            param.data[:, a - lo : b - lo].copy_(read_block(source, slice(a - offset, b - offset)).T)
        if shard_id == len(self.section_ranks) - 1:  # zero the padding rows after the last section
            pad_from = max(offset + rank, lo)
            if pad_from < hi:
                param.data[:, pad_from - lo :].zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Backward: the latents feed each rank's own heads/rows (``ShardedUp``), so their
        gradient is reduce-scattered; the replicated input's gradient is summed. The padding
        columns of ``Vᵀ`` never reach the output, so their gradient is exactly zero and they
        stay zero under any optimizer whose update of a zero-gradient, zero weight is zero
        (SGD, Adam, AdamW)."""
        x = comm.copy_to_tp(x, self.tp, site=self.prefix, layer=self.layer_number)
        latent = comm.all_gather_last_dim(
            x @ self.weight, self.tp, site=self.prefix, layer=self.layer_number,
            grad="reduce_scatter",
        )
        return torch.split(latent[..., : sum(self.section_ranks)], self.section_ranks, dim=-1)


class ShardedDown(_Down):
    """Each section's V rows split (balanced) over ranks, merged into one local GEMM; no
    communication. Shapes: in ``[..., in]`` → out tuple of ``[..., r_s/t]`` partial latents.
    """

    full_latents = False

    @staticmethod
    def _spans(section_ranks: tuple[int, ...], tp: TPView) -> tuple[Span, ...]:
        return tuple(balanced_split(r, tp) for r in section_ranks)

    @classmethod
    def _local_columns(cls, section_ranks: tuple[int, ...], tp: TPView) -> int:
        return sum(s.size for s in cls._spans(section_ranks, tp))

    @classmethod
    def _partition(cls, section_ranks: tuple[int, ...]) -> tuple[int, int]:
        return 1, len(section_ranks)  # each section's rows split: sections interleave

    @classmethod
    def _backward_collectives(cls, input_width: int, section_ranks: tuple[int, ...],
                              tp: TPView) -> tuple[Collective, ...]:
        return issued(tp, Collective("all_reduce", input_width))  # the replicated input

    @cached_property
    def spans(self) -> tuple[Span, ...]:
        """This rank's rows of each section's V."""
        return self._spans(self.section_ranks, self.tp)

    @cached_property
    def local_ranks(self) -> tuple[int, ...]:
        """Width of this rank's partial latent of each section."""
        return tuple(s.size for s in self.spans)

    def _load_weight(self, param: nn.Parameter, source: Any, shard_id: int) -> None:
        check_shape(source, self._source_shape(shard_id), self.prefix, f"V of section {shard_id}")
        offset = sum(self.local_ranks[:shard_id])
        span = self.spans[shard_id]
        param.data[:, offset : offset + span.size].copy_(read_block(source, span.slice).T)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Backward: the replicated input's gradient is summed over the ranks' row slices."""
        x = comm.copy_to_tp(x, self.tp, site=self.prefix, layer=self.layer_number)
        return torch.split(x @ self.weight, self.local_ranks, dim=-1)


class ReducedDown(_Down):
    """V (r × in) with its input columns split like the input (``input_span``, Megatron's even
    split by default); the partial latents are summed by one all-reduce of r elements per token.

    Shapes: in ``[..., input_span.size]`` → out 1-tuple of ``[..., r]`` (full latent).
    """

    @classmethod
    def _input_span(cls, input_size: int, section_ranks: tuple[int, ...], tp: TPView,
                    input_span: Span | None, prefix: str) -> Span:
        if len(section_ranks) != 1:
            raise ValueError(f"{prefix}: a row-parallel down factor has exactly one section")
        return input_span or balanced_split(input_size, tp)

    @classmethod
    def _local_columns(cls, section_ranks: tuple[int, ...], tp: TPView) -> int:
        return section_ranks[0]

    @classmethod
    def _partition(cls, section_ranks: tuple[int, ...]) -> tuple[int, int]:
        return 0, 1  # the input rows of Vᵀ

    @classmethod
    def _collectives(cls, section_ranks: tuple[int, ...], tp: TPView) -> tuple[Collective, ...]:
        return issued(tp, Collective("all_reduce", section_ranks[0]))

    def _load_weight(self, param: nn.Parameter, source: Any, shard_id: int) -> None:
        check_shape(source, self._source_shape(0), self.prefix, "V")
        param.data.copy_(read_block(source, slice(None), self.input_span.slice).T)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Backward: the all-reduce's is the identity (the input is this rank's own slice)."""
        partial = x @ self.weight
        return (comm.all_reduce_sum(partial, self.tp, site=self.prefix, layer=self.layer_number),)


# ----------------------------------------------------------------------------------------- up


class _Up(Factor):
    """An up factor: weights ``(sections, cols, rows)`` (``Uᵀ`` per section), zero-padded to the
    widest section.

    Subclasses say which rows this rank produces (``output_rows``), which columns of each
    section's U it holds (``_columns``), what each section's output costs in communication
    (``_collectives``) and what happens to it (``_finish``); allocation and ``cost`` both read
    them.

    Args:
        output_size: rows of one section's U (the full, unsharded output of a section).
        section_ranks: one rank per section.
        config: Megatron ``TransformerConfig`` (``params_dtype``, ``perform_initialization``).
        tp_group: the tensor-parallel process group, or a ``TPView`` for single-process tests.
        bias: whether each section has a bias (added once, by the caller).
        init_method: initialiser of the full U (``Factor._initialise``).
        unit_size: rows per output unit (the head dim for attention, 1 for MLP rows).
        layer_number, prefix: where the factor sits, for the ledger and for errors.
    """

    def __init__(
        self,
        output_size: int,
        section_ranks: Sequence[int],
        *,
        config: Any,
        tp_group: Any,
        bias: bool,
        init_method: InitMethod | None = None,
        unit_size: int = 1,
        layer_number: int = 0,
        prefix: str = "",
    ) -> None:
        super().__init__(tp_group, layer_number, prefix)
        self.output_size = output_size
        self.unit_size = unit_size
        self.section_ranks = section_ranks_of(section_ranks)
        self.output_span = self.output_rows(output_size, unit_size, self.tp)
        self.column_spans = tuple(self._columns(r, self.tp) for r in self.section_ranks)
        self.rows = self.output_span.size
        weight, bias_shape = self._shapes(output_size, self.section_ranks, self.tp, bias, unit_size)
        self.replicas = self._replicas(output_size, unit_size, self.tp)
        duplicate = self.tp.rank % self.replicas != 0  # a lower rank holds the same rows
        w_dim, b_dim = self._partition_dims
        self.weight = local_param(weight, config.params_dtype, partition_dim=w_dim,  # Uᵀ per section
                                  duplicate=duplicate)
        self.bias = None if bias_shape is None else local_param(
            bias_shape, config.params_dtype, partition_dim=b_dim, duplicate=duplicate)
        self._initialise(config, init_method)

    # (weight, bias) split dimensions of the stored ``(sections, cols, rows)`` / ``(sections,
    # rows)``; None: every rank holds them whole (replicated).
    _partition_dims: tuple[int | None, int | None] = (None, None)

    @classmethod
    def _replicas(cls, output_size: int, unit_size: int, tp: TPView) -> int:
        """How many ranks hold this rank's rows (more than one only for replicated units)."""
        return 1

    @classmethod
    def cost(cls, output_size: int, section_ranks: Sequence[int], *, tp: TPView, bias: bool,
             unit_size: int = 1, prefix: str = "") -> Cost:
        """Parameters rank ``tp.rank`` holds and the collectives it issues per token."""
        ranks = section_ranks_of(section_ranks)
        weight, bias_shape = cls._shapes(output_size, ranks, tp, bias, unit_size)
        sections, width, rows = weight
        return Cost(numel(weight) + numel(bias_shape), cls._collectives(rows, len(ranks), tp),
                    gemms=(Gemm(width, rows, sections),))  # one matmul, or one bmm of the sections

    @classmethod
    def _shapes(cls, output_size: int, section_ranks: tuple[int, ...], tp: TPView, bias: bool,
                unit_size: int) -> tuple[tuple[int, int, int], tuple[int, int] | None]:
        """(weight shape, bias shape or None) on rank ``tp.rank``."""
        rows = cls.output_rows(output_size, unit_size, tp).size
        width = max(cls._columns(r, tp).size for r in section_ranks)
        n = len(section_ranks)
        return (n, width, rows), ((n, rows) if bias else None)

    @classmethod
    def output_rows(cls, output_size: int, unit_size: int, tp: TPView) -> Span:
        """The rows of each section's output that rank ``tp.rank`` produces."""
        return Span.whole(output_size)

    @classmethod
    def _columns(cls, rank: int, tp: TPView) -> Span:
        return Span.whole(rank)

    @classmethod
    def _collectives(cls, rows: int, sections: int, tp: TPView) -> tuple[Collective, ...]:
        return ()

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def _source_shape(self, shard_id: int) -> tuple[int, int]:
        return (self.output_size, self.section_ranks[shard_id])

    def _load_weight(self, param: nn.Parameter, source: Any, shard_id: int) -> None:
        check_shape(source, self._source_shape(shard_id), self.prefix, "U")
        block = read_block(source, self.output_span.slice, self.column_spans[shard_id].slice)
        dst = param.data[shard_id]
        dst[: block.shape[1]].copy_(block.T)
        dst[block.shape[1] :].zero_()

    def _load_bias(self, param: nn.Parameter, source: Any, shard_id: int) -> None:
        check_shape(source, (self.output_size,), self.prefix, f"bias of section {shard_id}")
        param.data[shard_id].copy_(read_block(source, self.output_span.slice))

    def _trained(self, param: torch.Tensor) -> torch.Tensor:
        """``param`` as the forward pass uses it: where several ranks hold the same rows
        (``replicas`` > 1), their gradients are summed so that every copy gets the gradient of
        the whole model and the copies stay equal under training."""
        if self.replicas == 1:
            return param
        span = self.output_span

        def place(g: torch.Tensor) -> torch.Tensor:
            full = g.new_zeros(*g.shape[:-1], self.output_size)
            full[..., span.slice] = g
            return full

        return comm.sum_weight_grad_over_tp(param, self.tp, place, lambda f: f[..., span.slice],
                                            site=self.prefix, layer=self.layer_number)

    def _matmul(self, latents: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One GEMM per section, batched into a single ``bmm`` when there are several."""
        weight = self._trained(self.weight)
        if len(latents) == 1:
            return [latents[0] @ weight[0, : latents[0].shape[-1]]]
        width = weight.shape[1]
        lead = latents[0].shape[:-1]
        stacked = torch.stack(
            [F.pad(c.reshape(-1, c.shape[-1]), (0, width - c.shape[-1])) for c in latents]
        )
        out = torch.bmm(stacked, weight)
        return [o.reshape(*lead, self.rows) for o in out]

    def forward(self, latents: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sections side by side; the bias is returned to be added once, by the caller."""
        outs = [self._finish(o) for o in self._matmul(latents)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out, (None if self.bias is None else self._trained(self.bias).reshape(-1))


class ShardedUp(_Up):
    """U rows split by units (``unit_size`` rows each: a head, or 1 for MLP rows); each rank
    produces only its rows, no communication. Shapes: in tuple of ``[..., r_s]`` full latents
    → out ``[..., sections · rows]`` with sections side by side (Megatron's ``stride`` layout).
    """

    _partition_dims = (2, 1)  # the rows of each section's Uᵀ; the bias rows

    @classmethod
    def output_rows(cls, output_size: int, unit_size: int, tp: TPView) -> Span:
        return unit_split(output_size // unit_size, unit_size, tp)

    @classmethod
    def _replicas(cls, output_size: int, unit_size: int, tp: TPView) -> int:
        units = output_size // unit_size
        return tp.size // units if units < tp.size else 1

    def per_unit(self, z: torch.Tensor, unit_size: int) -> torch.Tensor:
        """Apply each unit's rows of U (and bias) to latents already mixed per unit.

        Value absorption: ``z [..., units, m, r]`` holds, for each of this rank's units (KV
        heads) and each of its ``m`` query heads, the attention-weighted latent ``P·C``; the
        result ``[..., units, m, unit_size]`` is ``P·(C Uᵀ) + b`` without forming ``C Uᵀ``.
        """
        units = self.rows // unit_size
        w = self.weight[0, : z.shape[-1]].view(z.shape[-1], units, unit_size)
        out = torch.einsum("...gmr,rgd->...gmd", z, w)
        if self.bias is not None:
            out = out + self.bias[0].view(units, 1, unit_size)
        return out


class ReducedUp(_Up):
    """U columns split like ``ShardedDown``'s rows; each section's full output is summed by one
    all-reduce. Shapes: in tuple of ``[..., r_s/t]`` → out ``[..., sections · out]``.
    The bias is replicated and returned to be added once (after the reduction).
    """

    _partition_dims = (1, None)  # the columns of each section's Uᵀ; the bias is replicated

    @classmethod
    def _columns(cls, rank: int, tp: TPView) -> Span:
        return balanced_split(rank, tp)

    @classmethod
    def _collectives(cls, rows: int, sections: int, tp: TPView) -> tuple[Collective, ...]:
        return issued(tp, *[Collective("all_reduce", rows)] * sections)

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce_sum(out, self.tp, site=self.prefix, layer=self.layer_number)


class ReplicatedUp(_Up):
    """The whole U on every rank, applied to a full latent; no communication. The bias is
    returned once (not scaled by TP). Shapes: in 1-tuple ``[..., r]`` → out ``[..., out]``.
    """


DownFactor = _Down  # every V factor (for selecting what to train)
UpFactor = _Up  # every U factor
