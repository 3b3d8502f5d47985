"""Megatron's dense column- and row-parallel linears, their collectives routed through our
counted comm.

Dense layers (the dense baseline, and the layers a rank config leaves undecomposed) are
Megatron's own ``SelfAttention``/``MLP`` — the attention as ``PagedSelfAttention``, which adds the
server's paged KV pool — with two subclasses of Megatron's linears whose only
change is that their collectives are issued by ``deinfer_megatron.parallel.comm`` — so that they
are counted like every other collective — with Megatron's autograd semantics kept: the row
linear's all-reduce of its output (backward: identity) and the column linear's
identity on its replicated input (backward: all-reduce of the input gradient, Megatron's
``copy_to_tensor_model_parallel_region``/``allreduce_dgrad``). Parameters, sharding,
tensor-parallel attributes and initialisation are Megatron's.

``dense_attention_cost`` and ``dense_mlp_cost`` say what those blocks cost one rank (parameters,
collectives per token, KV heads cached), for the planner, the way the factor classes do for
decomposed blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention

from deinfer_megatron.layers.core_attention import MEGATRON, SdpaCoreAttention
from deinfer_megatron.layers.costs import Attend, Collective, Cost, Gemm, issued
from deinfer_megatron.layers.paged_cache import PagedContext, paged_dense_attention
from deinfer_megatron.parallel import comm
from deinfer_megatron.parallel.topology import TPView, balanced_split, unit_split


class CountedColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` (output rows split over ranks, input replicated) whose backward
    all-reduce of the input gradient is issued and counted by ``parallel.comm``.

    Extra args: ``layer_number`` and ``prefix`` name the collective in the ledger.
    Shapes: in ``[s, b, in]`` (the same on every rank) → out ``[s, b, out/t]``.
    """

    def __init__(self, *args: Any, layer_number: int = 0, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layer_number = layer_number
        self.prefix = prefix
        self._tp = TPView.of(self.tp_group)
        if self.gather_output or self.sequence_parallel:
            raise ValueError(f"{self.prefix}: the counted column linear neither gathers its output "
                             "nor runs sequence-parallel; use Megatron's ColumnParallelLinear")

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if weight is not None or runtime_gather_output:
            raise ValueError(f"{self.prefix}: the counted column linear uses its own weight and "
                             "does not gather its output")
        x = comm.copy_to_tp(input_, self._tp, site=self.prefix, layer=self.layer_number)
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias), None


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


class PagedSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` (parameters, sharding, forward and its static and dynamic
    inference paths unchanged) that also runs under the server's ``PagedContext``, where every
    token has its own sequence, position and KV block: ``paged_cache.paged_dense_attention``.

    A decomposed model keeps some attention blocks dense (an allocation that finds a block's
    factors no smaller than its matrices, the dense layout); without this the server could not
    run it. ``paged_core`` attends over this rank's heads and holds no parameters, so checkpoints
    are Megatron's."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.paged_core = SdpaCoreAttention(
            config, self.layer_number, num_heads=self.num_attention_heads_per_partition,
            num_kv_heads=self.num_query_groups_per_partition, head_dim=self.hidden_size_per_attention_head)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        inference_context: Any = None,
        rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        *args: Any,
        inference_params: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        context = inference_context if inference_context is not None else inference_params
        if isinstance(context, PagedContext):
            if key_value_states is not None:
                raise NotImplementedError("cross-attention is not supported under a PagedContext")
            return paged_dense_attention(self, hidden_states, context, rotary_pos_emb)
        return super().forward(hidden_states, attention_mask, key_value_states, inference_context, rotary_pos_emb,
                               *args, inference_params=inference_params, **kwargs)


def dense_attention_cost(config: Any, tp: TPView, *, rotary: bool) -> Cost:
    """Megatron's ``SelfAttention`` on rank ``tp.rank``: ``linear_qkv`` column-parallel by heads
    (bias when ``add_qkv_bias`` or ``add_bias_linear``, as Megatron decides), ``linear_proj``
    row-parallel over this rank's query heads with one all-reduce of ``hidden`` (its bias
    replicated); K/V cached for this rank's KV heads, attended by Megatron's
    ``DotProductAttention`` over this rank's query heads — with ``rotary`` (the model's
    positions are RoPE) every cached key rotated again at each step first, since Megatron's
    static-batching cache holds keys before RoPE. Backward: one all-reduce of ``hidden`` (the
    gradient of ``linear_qkv``'s replicated input)."""
    h, d = config.hidden_size, config.kv_channels
    q_span = unit_split(config.num_attention_heads, d, tp)
    kv_span = unit_split(config.num_query_groups, d, tp)
    rows = q_span.size + 2 * kv_span.size
    qkv_bias = config.add_qkv_bias or config.add_bias_linear
    params = rows * h + (rows if qkv_bias else 0) + h * q_span.size + (h if config.add_bias_linear else 0)
    return Cost(params, issued(tp, Collective("all_reduce", h)), kv_heads=kv_span.size // d,
                backward=issued(tp, Collective("all_reduce", h)),  # linear_qkv's input gradient
                gemms=(Gemm(h, rows, transposed=True), Gemm(q_span.size, h, transposed=True)),
                attends=(Attend(MEGATRON, q_span.size // d, kv_span.size // d, d, rotary),))


def dense_mlp_cost(config: Any, tp: TPView) -> Cost:
    """Megatron's ``MLP`` on rank ``tp.rank``: ``linear_fc1`` column-parallel over the
    intermediate rows (gate and up sections when gated), ``linear_fc2`` row-parallel with one
    all-reduce of ``hidden``; biases when ``add_bias_linear``."""
    h, bias = config.hidden_size, config.add_bias_linear
    i_span = balanced_split(config.ffn_hidden_size, tp)
    rows = (2 if config.gated_linear_unit else 1) * i_span.size
    params = rows * h + (rows if bias else 0) + h * i_span.size + (h if bias else 0)
    return Cost(params, issued(tp, Collective("all_reduce", h)),
                backward=issued(tp, Collective("all_reduce", h)),  # linear_fc1's input gradient
                gemms=(Gemm(h, rows, transposed=True), Gemm(i_span.size, h, transposed=True)))
