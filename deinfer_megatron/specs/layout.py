"""The parallel layout: the one place where naive, DeInfer and dense are told apart.

A layout is a value: which factor class fills each slot of a decomposed attention block and of
a decomposed MLP. ``dense`` has no factor classes: every layer is built as Megatron's dense
tensor-parallel layer (a decomposed checkpoint is multiplied out at load time).

The spec builder puts these classes into the slots, and the planner asks the same classes what
they cost (their ``cost`` class methods), so a new layout is one entry in ``FACTOR_CLASSES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from deinfer_megatron.layers.factored_linear import (
    DeInferColumnLinear,
    DeInferRowLinear,
    NaiveFactoredLinear,
)
from deinfer_megatron.layers.factors import GatheredDown, ReducedUp, ShardedDown, ShardedUp


class Layout(str, Enum):
    DENSE = "dense"
    NAIVE = "naive"
    DEINFER = "deinfer"

    @classmethod
    def parse(cls, value: "str | Layout") -> "Layout":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown layout {value!r}; choose one of {', '.join(m.value for m in cls)}"
            ) from None

    @property
    def factor_classes(self) -> "FactorClasses | None":
        """The classes of this layout's decomposed blocks; None: every block is Megatron's dense one."""
        return FACTOR_CLASSES[self]

    @property
    def multiplies_out(self) -> bool:
        """No factor classes: every block is Megatron's dense layer, and a decomposed checkpoint
        is served with its factors multiplied out (``W = U·V``) at load time."""
        return FACTOR_CLASSES[self] is None

    @property
    def supports_latent_cache(self) -> bool:
        """The latent KV cache needs every latent whole on every rank: a layout whose merged
        q/k/v down factor leaves them so (its ``full_latents``)."""
        classes = FACTOR_CLASSES[self]
        return classes is not None and classes.qkv_down.full_latents


@dataclass(frozen=True)
class FactorClasses:
    """Classes for the slots of decomposed blocks under one layout."""

    qkv_down: type  # merged V_q|V_k|V_v
    qkv_up: type  # each of U_q, U_k, U_v
    column: type  # a whole factor pair in a column slot (linear_fc1)
    row: type  # a whole factor pair in a row slot (linear_proj, linear_fc2)


FACTOR_CLASSES: dict[Layout, FactorClasses | None] = {
    Layout.DEINFER: FactorClasses(GatheredDown, ShardedUp, DeInferColumnLinear, DeInferRowLinear),
    Layout.NAIVE: FactorClasses(ShardedDown, ReducedUp, NaiveFactoredLinear, NaiveFactoredLinear),
    Layout.DENSE: None,
}
