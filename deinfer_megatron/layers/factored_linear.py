"""Decomposed linears that drop into Megatron's linear slots (``linear_fc1``, ``linear_fc2``,
``linear_proj``): a down factor and an up factor behind Megatron's constructor signature and
its ``forward(x) -> (output, bias)`` contract.

``stride`` keeps Megatron's meaning for a gated ``linear_fc1``: the output is ``stride``
equal sections (gate, up) and each rank returns its slice of every section side by side, so
Megatron's ``MLP`` splits ``[gate_local, up_local]`` exactly as it does for its own layers.
Each section is its own decomposed matrix with its own rank (``ranks`` has one entry per
section); their V factors are merged into one GEMM and their U factors run as one batched GEMM.

Initialisation: both factors of a pair take the ``init_method`` Megatron passes to the slot —
``config.init_method`` for ``linear_fc1``, ``config.output_layer_init_method`` for
``linear_fc2`` and ``linear_proj``. The pair *is* the slot's matrix, so it keeps the slot's
choice: the row slots write into the residual stream, and Megatron's smaller, depth-scaled
std there is what keeps a freshly built deep model's activations bounded. (The product of two
such factors has a different spread than one matrix; decomposed models are loaded from a
checkpoint, and initialisation serves tests and training the factors from scratch.)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from deinfer_megatron.arch.ranks import MlpRanks
from deinfer_megatron.layers.costs import Cost
from deinfer_megatron.layers.factors import (
    GatheredDown,
    ReducedDown,
    ReducedUp,
    ReplicatedUp,
    ShardedDown,
    ShardedUp,
)
from deinfer_megatron.layers.sharded_state import children_sharded_state_dict
from deinfer_megatron.parallel.topology import Span, TPView


class FactoredLinear(nn.Module):
    """``y = U (V x) + b`` with the factors sharded by ``down_factor`` / ``up_factor``.

    Args:
        input_size, output_size: the full (unsharded) matrix shape, as Megatron passes them.
        config: the Megatron ``TransformerConfig`` (``params_dtype``; ``perform_initialization``).
        init_method: the slot's initialiser, used for both factors (see the module docstring).
        bias: whether the matrix has a bias (owned by U).
        gather_output: Megatron's column option; refused (the layout decides what is gathered).
        input_is_parallel: Megatron's row option; implied by the class (row classes read their
            ``input_span``), accepted for the signature.
        stride: number of equal output sections (2 for a gated fc1), each its own factor pair.
        skip_bias_add: return the bias separately (Megatron's fusion contract).
        is_expert: Megatron's MoE flag; refused (decomposed experts are not supported).
        tp_comm_buffer_name: names Transformer Engine's communication buffers; there are none
            here (every collective goes through ``parallel.comm``), accepted for the signature.
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
    ) -> None:
        super().__init__()
        down, up = self._factor_args(input_size, output_size, ranks=ranks, stride=stride, bias=bias,
                                     unit_size=unit_size, input_span=input_span, prefix=prefix)
        if gather_output:
            raise ValueError(f"{prefix}: decomposed linears do not gather their output")
        if is_expert:
            raise ValueError(f"{prefix}: decomposed experts (MoE) are not supported")
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.ranks = down["section_ranks"]
        common = dict(config=config, tp_group=tp_group, init_method=init_method, layer_number=layer_number)
        self.down = self.down_factor(**down, **common)
        self.up = self.up_factor(**up, **common)

    @classmethod
    def cost(cls, input_size: int, output_size: int, *, tp: TPView, ranks: int | Sequence[int],
             bias: bool = True, stride: int = 1, unit_size: int = 1, input_span: Span | None = None,
             prefix: str = "") -> Cost:
        """What rank ``tp.rank`` of this layer holds and issues: its down factor's cost plus its
        up factor's, for the arguments the constructor would get."""
        down, up = cls._factor_args(input_size, output_size, ranks=ranks, stride=stride, bias=bias,
                                    unit_size=unit_size, input_span=input_span, prefix=prefix)
        return cls.down_factor.cost(**down, tp=tp) + cls.up_factor.cost(**up, tp=tp)

    @staticmethod
    def _factor_args(input_size: int, output_size: int, *, ranks: int | Sequence[int], stride: int,
                     bias: bool, unit_size: int, input_span: Span | None,
                     prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The arguments of the down and the up factor (shared by ``__init__`` and ``cost``)."""
        section_ranks = (ranks,) * stride if isinstance(ranks, int) else tuple(ranks)
        if len(section_ranks) != stride or not all(r > 0 for r in section_ranks):
            raise ValueError(
                f"{prefix}: expected {stride} positive rank(s) (one per output section), "
                f"got {section_ranks}"
            )
        if output_size % stride:
            raise ValueError(f"{prefix}: output size {output_size} is not {stride} equal sections")
        down = dict(input_size=input_size, section_ranks=section_ranks, input_span=input_span,
                    prefix=f"{prefix}.down")
        up = dict(output_size=output_size // stride, section_ranks=section_ranks, bias=bias,
                  unit_size=unit_size, prefix=f"{prefix}.up")
        return down, up

    @property
    def output_span(self) -> Span:
        """This rank's rows of one output section (the whole section when replicated)."""
        return self.up.output_span

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, bias = self.up(self.down(x))
        if self.skip_bias_add or bias is None:
            return out, bias if self.skip_bias_add else None
        return out + bias, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """Megatron dist-checkpointing: the factors' own (``layers.sharded_state``)."""
        return children_sharded_state_dict(self, prefix, sharded_offsets, metadata)

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


def factored_mlp_cost(config: Any, column: type[FactoredLinear], row: type[FactoredLinear],
                      ranks: MlpRanks, tp: TPView) -> Cost:
    """Megatron's ``MLP`` with ``column`` in ``linear_fc1`` and ``row`` in ``linear_fc2``, built
    as ``MLP.__init__`` builds them: fc1 ``hidden → ffn`` (doubled, stride 2, when gated), fc2
    ``ffn → hidden``, both with ``add_bias_linear``; the ranks are the spec's (fc1: the up
    sections, fc2: the down rank). What rank ``tp.rank`` holds and issues per token."""
    stride = 2 if config.gated_linear_unit else 1
    fc1 = column.cost(config.hidden_size, config.ffn_hidden_size * stride, tp=tp,
                      ranks=ranks.up_sections, bias=config.add_bias_linear, stride=stride)
    fc2 = row.cost(config.ffn_hidden_size, config.hidden_size, tp=tp, ranks=(ranks.down,),
                   bias=config.add_bias_linear)
    return fc1 + fc2
