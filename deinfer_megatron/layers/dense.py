"""Megatron's dense row-parallel linear, with its all-reduce routed through our counted comm.

Dense layers (the dense baseline, and the layers a rank config leaves undecomposed) are
Megatron's own ``SelfAttention``/``MLP`` with ``ColumnParallelLinear`` — which communicates
nothing in the forward pass when ``gather_output=False`` — and this subclass of
``RowParallelLinear``, whose only change is that the all-reduce of its output is issued by
``deinfer_megatron.parallel.comm`` so that it is counted like every other collective.
Parameters, sharding and initialisation are Megatron's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import RowParallelLinear

from deinfer_megatron.parallel import comm
from deinfer_megatron.parallel.topology import TPView


class CountedRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` (input split over ranks, all-reduce of the full output).

    Extra args: ``layer_number`` and ``prefix`` name the collective in the ledger.
    Shapes: in ``[s, b, in/t]`` → out ``[s, b, out]`` on every rank.
    """

    def __init__(self, *args: Any, layer_number: int = 0, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layer_number = layer_number
        self.prefix = prefix
        self._tp = TPView.of(self.tp_group)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            raise ValueError(f"{self.prefix}: the dense row-parallel linear expects its input split")
        out = comm.all_reduce_sum(
            F.linear(input_, self.weight), self._tp, site=self.prefix, layer=self.layer_number
        )
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None
