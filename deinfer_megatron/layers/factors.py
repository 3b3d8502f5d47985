"""The factors of a decomposed matrix ``W ≈ U·V``, one module per way of sharding a factor.

``V`` (r × in) is a *down* factor: it maps the input to the rank-r latent. ``U`` (out × r) is an
*up* factor: it maps the latent to the output. A decomposed block may merge several matrices
that read the same input ("sections": q, k, v; or gate, up) into one down factor, so a down
factor takes the tuple of its section ranks and returns one latent per section.

Weights are stored input-major — ``Vᵀ`` as ``(in, r)``, ``Uᵀ`` as ``(sections, r, out)`` — and
applied as ``x @ W``: for the few rows of a decode step, CPU BLAS runs a GEMM about twice as
fast from a row-major ``(in, out)`` operand as from Megatron's ``(out, in)`` (measured 19-22
against 9 GB/s effective at 8 × 2048 on this project's 2-core machines), and large prefill
GEMMs are no slower. Checkpoints keep the usual ``U``/``V`` orientation; loaders transpose.

Each module allocates only its local shard and knows how to fill it: ``loader_for(name)``
returns a ``weight_loader(param, source, shard_id)`` where ``source`` is the *full* (unsharded)
tensor of one Hugging Face matrix — a ``torch.Tensor`` or a lazily-read safetensors slice — and
the loader reads just the rows/columns this rank holds. ``shard_id`` is the section index.

Down factors (input ``[..., in]`` or this rank's input slice):
  * ``GatheredDown``  — DeInfer column side: merged V rows split over ranks (zero-padded to a
    multiple of TP), one all-gather of Σr; every rank then holds every full latent.
  * ``ShardedDown``   — naive: each section's rows split over ranks, no communication; the
    latents stay partial (this rank's r/t slice).
  * ``ReducedDown``   — DeInfer row side: V's input columns split like the input, one
    all-reduce of r; every rank then holds the full latent.
Up factors (weights ``(sections, rows, cols)``; biases ``(sections, rows)``):
  * ``ShardedUp``     — DeInfer column side: rows split by units (heads or single rows); no
    communication; sections run as one batched GEMM.
  * ``ReducedUp``     — naive: columns split like ``ShardedDown``; all-reduce of the full output
    per section; bias added once after the reduction.
  * ``ReplicatedUp``  — DeInfer row side: the whole U on every rank, bias added once.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deinfer_megatron.parallel import comm
from deinfer_megatron.parallel.topology import Span, TPView, balanced_split, padded_chunk, unit_split


def read_block(source: Any, rows: slice, cols: slice | None = None) -> torch.Tensor:
    """Read ``source[rows, cols]`` from a tensor or a lazy safetensors slice."""
    block = source[rows] if cols is None else source[rows, cols]
    return block if isinstance(block, torch.Tensor) else torch.as_tensor(block)


def _check_shape(source: Any, expected: tuple[int, ...], prefix: str, what: str) -> None:
    got = tuple(source.shape if isinstance(source, torch.Tensor) else source.get_shape())
    if got != expected:
        raise ValueError(
            f"{prefix}: {what} has shape {list(got)} but the model config and rank config "
            f"expect {list(expected)}; check that the checkpoint matches its rank_config.json"
        )


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class _Factor(nn.Module):
    """Shared bookkeeping: the TP view, the Megatron layer number and a name for errors."""

    def __init__(self, tp_group: Any, layer_number: int, prefix: str) -> None:
        super().__init__()
        self.tp = TPView.of(tp_group)
        self.layer_number = layer_number
        self.prefix = prefix

    def extra_repr(self) -> str:
        return f"tp={self.tp.rank}/{self.tp.size}"

    def loader_for(self, name: str) -> tuple[Any, int]:
        """``(weight_loader, number of shard ids)`` for parameter ``name`` of this module.

        Looked up when loading (not stored on the parameter), so it survives ``to_empty``.
        """
        return getattr(self, f"_load_{name}"), len(self.section_ranks)


# --------------------------------------------------------------------------------------- down


class _Down(_Factor):
    """A down factor ``Vᵀ`` (in, cols) over one or more sections sharing one input.

    Subclasses set up their split in ``_columns()``, which returns this rank's column count.
    """

    def __init__(
        self,
        input_size: int,
        section_ranks: Sequence[int],
        *,
        config: Any,
        tp_group: Any,
        input_span: Span | None = None,
        layer_number: int = 0,
        prefix: str = "",
        **_: Any,
    ) -> None:
        super().__init__(tp_group, layer_number, prefix)
        self.section_ranks = tuple(int(r) for r in section_ranks)
        self.input_size = input_size
        self.input_span = input_span or Span.whole(input_size)
        cols = self._columns()
        self.weight = _param((self.input_span.size, cols), config.params_dtype)  # Vᵀ

    def _columns(self) -> int:
        raise NotImplementedError


class GatheredDown(_Down):
    """Merged ``V = [V_0; V_1; ...]`` (Σr × in), rows split evenly after zero-padding to a
    multiple of TP. Rank i holds padded rows ``[i·c, (i+1)·c)``; one all-gather of ``t·c``
    elements per token rebuilds every section's full latent on every rank.

    Shapes: in ``[..., in]`` → out tuple of ``[..., r_s]`` (full latents).
    """

    full_latents = True  # every rank holds whole latents: they can be cached and re-expanded

    def _columns(self) -> int:
        self.chunk = padded_chunk(sum(self.section_ranks), self.tp.size)
        return self.chunk

    def _load_weight(self, param: nn.Parameter, source: Any, shard_id: int) -> None:
        rank = self.section_ranks[shard_id]
        _check_shape(source, (rank, self.input_size), self.prefix, f"V of section {shard_id}")
        offset = sum(self.section_ranks[:shard_id])
        lo, hi = self.tp.rank * self.chunk, (self.tp.rank + 1) * self.chunk
        a, b = max(lo, offset), min(hi, offset + rank)
        if a < b:
            param.data[:, a - lo : b - lo].copy_(read_block(source, slice(a - offset, b - offset)).T)
        if shard_id == len(self.section_ranks) - 1:  # zero the padding rows after the last section
            pad_from = max(offset + rank, lo)
            if pad_from < hi:
                param.data[:, pad_from - lo :].zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        latent = comm.all_gather_last_dim(
            x @ self.weight, self.tp, site=self.prefix, layer=self.layer_number
        )
        return torch.split(latent[..., : sum(self.section_ranks)], self.section_ranks, dim=-1)


class ShardedDown(_Down):
    """Each section's V rows split (balanced) over ranks, merged into one local GEMM; no
    communication. Shapes: in ``[..., in]`` → out tuple of ``[..., r_s/t]`` partial latents.
    """

    full_latents = False

    def _columns(self) -> int:
        self.spans = tuple(balanced_split(r, self.tp) for r in self.section_ranks)
        self.local_ranks = tuple(s.size for s in self.spans)
        return sum(self.local_ranks)

    def _load_weight(self, param: nn.Parameter, source: Any, shard_id: int) -> None:
        rank = self.section_ranks[shard_id]
        _check_shape(source, (rank, self.input_size), self.prefix, f"V of section {shard_id}")
        offset = sum(self.local_ranks[:shard_id])
        span = self.spans[shard_id]
        param.data[:, offset : offset + span.size].copy_(read_block(source, span.slice).T)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(x @ self.weight, self.local_ranks, dim=-1)


class ReducedDown(_Down):
    """V (r × in) with its input columns split like the input (``input_span``, Megatron's even
    split by default); the partial latents are summed by one all-reduce of r elements per token.

    Shapes: in ``[..., input_span.size]`` → out 1-tuple of ``[..., r]`` (full latent).
    """

    def __init__(self, input_size: int, section_ranks: Sequence[int], *, tp_group: Any,
                 input_span: Span | None = None, prefix: str = "", **kwargs: Any) -> None:
        if len(section_ranks) != 1:
            raise ValueError(f"{prefix}: a row-parallel down factor has exactly one section")
        span = input_span or balanced_split(input_size, TPView.of(tp_group))
        super().__init__(input_size, section_ranks, tp_group=tp_group, input_span=span,
                         prefix=prefix, **kwargs)

    def _columns(self) -> int:
        return self.section_ranks[0]

    def _load_weight(self, param: nn.Parameter, source: Any, shard_id: int) -> None:
        _check_shape(source, (self.section_ranks[0], self.input_size), self.prefix, "V")
        param.data.copy_(read_block(source, slice(None), self.input_span.slice).T)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        partial = x @ self.weight
        return (comm.all_reduce_sum(partial, self.tp, site=self.prefix, layer=self.layer_number),)


# ----------------------------------------------------------------------------------------- up


class _Up(_Factor):
    """An up factor: weights ``(sections, cols, rows)`` (``Uᵀ`` per section), zero-padded to the
    widest section.

    Subclasses say which rows this rank produces (``_rows``), which columns of each section's
    U it holds (``_columns``), and what happens to each section's output (``_finish``).
    """

    def __init__(
        self,
        output_size: int,
        section_ranks: Sequence[int],
        *,
        config: Any,
        tp_group: Any,
        bias: bool,
        unit_size: int = 1,
        layer_number: int = 0,
        prefix: str = "",
        **_: Any,
    ) -> None:
        super().__init__(tp_group, layer_number, prefix)
        self.output_size = output_size
        self.section_ranks = tuple(int(r) for r in section_ranks)
        self.output_span = self._rows(output_size, unit_size)
        self.column_spans = tuple(self._columns(r) for r in self.section_ranks)
        self.rows = self.output_span.size
        n = len(self.section_ranks)
        width = max(c.size for c in self.column_spans)
        self.weight = _param((n, width, self.rows), config.params_dtype)  # Uᵀ per section
        self.bias = _param((n, self.rows), config.params_dtype) if bias else None

    def _rows(self, output_size: int, unit_size: int) -> Span:
        return Span.whole(output_size)

    def _columns(self, rank: int) -> Span:
        return Span.whole(rank)

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def _load_weight(self, param: nn.Parameter, source: Any, shard_id: int) -> None:
        _check_shape(source, (self.output_size, self.section_ranks[shard_id]), self.prefix, "U")
        block = read_block(source, self.output_span.slice, self.column_spans[shard_id].slice)
        dst = param.data[shard_id]
        dst[: block.shape[1]].copy_(block.T)
        dst[block.shape[1] :].zero_()

    def _load_bias(self, param: nn.Parameter, source: Any, shard_id: int) -> None:
        _check_shape(source, (self.output_size,), self.prefix, f"bias of section {shard_id}")
        param.data[shard_id].copy_(read_block(source, self.output_span.slice))

    def _matmul(self, latents: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One GEMM per section, batched into a single ``bmm`` when there are several."""
        if len(latents) == 1:
            return [latents[0] @ self.weight[0, : latents[0].shape[-1]]]
        width = self.weight.shape[1]
        lead = latents[0].shape[:-1]
        stacked = torch.stack(
            [F.pad(c.reshape(-1, c.shape[-1]), (0, width - c.shape[-1])) for c in latents]
        )
        out = torch.bmm(stacked, self.weight)
        return [o.reshape(*lead, self.rows) for o in out]

    def forward(self, latents: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sections side by side; the bias is returned to be added once, by the caller."""
        outs = [self._finish(o) for o in self._matmul(latents)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out, (None if self.bias is None else self.bias.reshape(-1))


class ShardedUp(_Up):
    """U rows split by units (``unit_size`` rows each: a head, or 1 for MLP rows); each rank
    produces only its rows, no communication. Shapes: in tuple of ``[..., r_s]`` full latents
    → out ``[..., sections · rows]`` with sections side by side (Megatron's ``stride`` layout).
    """

    def _rows(self, output_size: int, unit_size: int) -> Span:
        return unit_split(output_size // unit_size, unit_size, self.tp)

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

    def _columns(self, rank: int) -> Span:
        return balanced_split(rank, self.tp)

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce_sum(out, self.tp, site=self.prefix, layer=self.layer_number)


class ReplicatedUp(_Up):
    """The whole U on every rank, applied to a full latent; no communication. The bias is
    returned once (not scaled by TP). Shapes: in 1-tuple ``[..., r]`` → out ``[..., out]``.
    """
