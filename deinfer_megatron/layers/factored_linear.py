"""Decomposed linears that drop into Megatron's linear slots (``linear_fc1``, ``linear_fc2``,
``linear_proj``): a down factor and an up factor behind Megatron's constructor signature and
its ``forward(x) -> (output, bias)`` contract.

``stride`` keeps Megatron's meaning for a gated ``linear_fc1``: the output is ``stride``
equal sections (gate, up) and each rank returns its slice of every section side by side, so
Megatron's ``MLP`` splits ``[gate_local, up_local]`` exactly as it does for its own layers.
Each section is its own decomposed matrix with its own rank (``ranks`` has one entry per
section); their V factors are merged into one GEMM and their U factors run as one batched GEMM.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from deinfer_megatron.layers.factors import (
    GatheredDown,
    ReducedDown,
    ReducedUp,
    ReplicatedUp,
    ShardedDown,
    ShardedUp,
)
from deinfer_megatron.parallel.topology import Span


class FactoredLinear(nn.Module):
    """``y = U (V x) + b`` with the factors sharded by ``down_factor`` / ``up_factor``.

    Args:
        input_size, output_size: the full (unsharded) matrix shape, as Megatron passes them.
        config: the Megatron ``TransformerConfig`` (``params_dtype`` is used).
        bias: whether the matrix has a bias (owned by U).
        stride: number of equal output sections (2 for a gated fc1), each its own factor pair.
        skip_bias_add: return the bias separately (Megatron's fusion contract).
        tp_group: the tensor-parallel process group (or a ``TPView`` for single-process tests).
        ranks: one rank per section.
        unit_size: rows per output unit (the head dim for attention outputs).
        input_span: this rank's slice of the input for row-parallel down factors; Megatron's
            even split of ``input_size`` when omitted.
        layer_number, prefix: where the layer sits, for communication accounting and errors.
    """

    down_factor: type = nn.Module
    up_factor: type = nn.Module

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable | None = None,
        bias: bool = True,
        gather_output: bool = False,
        input_is_parallel: bool = False,
        stride: int = 1,
        skip_bias_add: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: Any = None,
        ranks: int | Sequence[int] = (),
        unit_size: int = 1,
        input_span: Span | None = None,
        layer_number: int = 0,
        prefix: str = "",
        **kwargs: Any,
    ) -> None:
        super().__init__()
        section_ranks = (ranks,) * stride if isinstance(ranks, int) else tuple(ranks)
        if len(section_ranks) != stride or not all(r > 0 for r in section_ranks):
            raise ValueError(
                f"{prefix}: expected {stride} positive rank(s) (one per output section), "
                f"got {section_ranks}"
            )
        if gather_output:
            raise ValueError(f"{prefix}: decomposed linears do not gather their output")
        if is_expert:
            raise ValueError(f"{prefix}: decomposed experts (MoE) are not supported")
        if output_size % stride:
            raise ValueError(f"{prefix}: output size {output_size} is not {stride} equal sections")
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.ranks = section_ranks
        self.down = self.down_factor(
            input_size,
            section_ranks,
            config=config,
            tp_group=tp_group,
            input_span=input_span,
            layer_number=layer_number,
            prefix=f"{prefix}.down",
        )
        self.up = self.up_factor(
            output_size // stride,
            section_ranks,
            config=config,
            tp_group=tp_group,
            bias=bias,
            unit_size=unit_size,
            layer_number=layer_number,
            prefix=f"{prefix}.up",
        )

    @property
    def output_span(self) -> Span:
        """This rank's rows of one output section (the whole section when replicated)."""
        return self.up.output_span

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, bias = self.up(self.down(x))
        if self.skip_bias_add or bias is None:
            return out, bias if self.skip_bias_add else None
        return out + bias, None

    def backward_dw(self) -> None:
        """Megatron calls this after a delayed weight-gradient pass; inference has none."""


class DeInferColumnLinear(FactoredLinear):
    """DeInfer column type: merged V split over ranks + one all-gather of Σr; U column-parallel
    (rows by unit), no further communication. Output: this rank's rows of every section."""

    down_factor = GatheredDown
    up_factor = ShardedUp


class DeInferRowLinear(FactoredLinear):
    """DeInfer row type: V row-parallel over this rank's input slice + one all-reduce of r;
    U replicated, bias added once. Output: the full ``output_size`` on every rank."""

    down_factor = ReducedDown
    up_factor = ReplicatedUp


class NaiveFactoredLinear(FactoredLinear):
    """The naive baseline for either slot: input is the full activation on every rank; V
    column-parallel over r (no communication), U row-parallel with one all-reduce of the full
    output per section. Output: the full activation on every rank (duplicated downstream)."""

    down_factor = ShardedDown
    up_factor = ReducedUp
