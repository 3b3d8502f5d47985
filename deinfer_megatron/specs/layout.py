"""The parallel layout: the one place where naive, DeInfer and dense are told apart.

A layout is a value: which factor class fills each slot of a decomposed attention block and of
a decomposed MLP. ``dense`` has no factor classes: every layer is built as Megatron's dense
tensor-parallel layer (a decomposed checkpoint is multiplied out at load time).

The spec builder puts these classes into the slots, and the planner asks the same classes what
they cost (their ``cost`` class methods), so a new layout is one ``Layout`` member and its entry
in ``FACTOR_CLASSES``: ``--layout auto`` prices every entry (in the table's order on a tie), the
commands offer every member, ``serve`` and ``heal`` every layout with factor classes.

Below ``planning`` a layout is always a ``Layout`` or a ``LayoutPlan``, never a string: what a
user asks for (``auto`` or a fixed layout) is ``planning.request.LayoutRequest``.
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
from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.specs.rank_config import RankConfig


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


# The layout table, in the order ``--layout auto`` prefers its entries when two price the same.
FACTOR_CLASSES: dict[Layout, FactorClasses | None] = {
    Layout.DEINFER: FactorClasses(GatheredDown, ShardedUp, DeInferColumnLinear, DeInferRowLinear),
    Layout.NAIVE: FactorClasses(ShardedDown, ReducedUp, NaiveFactoredLinear, NaiveFactoredLinear),
    Layout.DENSE: None,
}


def factored_layouts() -> tuple[Layout, ...]:
    """The layouts that keep the factors (``serve`` and ``heal`` run these), in table order."""
    return tuple(layout for layout, classes in FACTOR_CLASSES.items() if classes is not None)


def latent_cache_layouts() -> str:
    """The layouts that can keep the latent cache, as a user reads them (``deinfer``)."""
    return " or ".join(layout.value for layout in FACTOR_CLASSES if layout.supports_latent_cache)


@dataclass(frozen=True)
class BlockLayouts:
    """The layouts of one transformer layer's two blocks."""

    attention: Layout
    mlp: Layout


@dataclass(frozen=True)
class LayoutPlan:
    """A layout per block of every layer: what ``--layout auto`` builds, passed wherever a
    ``Layout`` is. A single ``Layout`` is the uniform plan (``LayoutPlan.uniform``); the
    classes of each block still come from ``FACTOR_CLASSES`` only.

    A block whose layout is ``dense`` is Megatron's dense block: its factors are multiplied out
    at load time, while the other blocks of the same model stay factored.
    """

    layers: tuple[BlockLayouts, ...]
    name: str  # how the plan is shown: what was asked for (``auto``), or the uniform layout's name

    @classmethod
    def uniform(cls, layout: "Layout | str", num_layers: int) -> "LayoutPlan":
        layout = Layout.parse(layout)
        return cls(tuple(BlockLayouts(layout, layout) for _ in range(num_layers)), layout.value)

    @property
    def value(self) -> str:
        return self.name

    @property
    def uniform_layout(self) -> Layout | None:
        """The layout of every block when they all share one, else None."""
        kinds = {k for b in self.layers for k in (b.attention, b.mlp)}
        return next(iter(kinds)) if len(kinds) == 1 else None

    @property
    def multiplies_out(self) -> bool:
        """Every block is dense: the whole model is served multiplied out."""
        return all(b.attention.multiplies_out and b.mlp.multiplies_out for b in self.layers)

    @property
    def supports_latent_cache(self) -> bool:
        """The latent cache keeps whole latents of every factored attention block; a dense
        attention block (a layer chosen dense) keeps full K/V, as a dense layer always does."""
        factored = [b.attention for b in self.layers if not b.attention.multiplies_out]
        return bool(factored) and all(a.supports_latent_cache for a in factored)

    def dense_modules(self, arch: ModelArch) -> set[str]:
        """Hugging Face names of the linear modules in blocks this plan builds dense."""
        out: set[str] = set()
        for i, block in enumerate(self.layers):
            if block.attention.multiplies_out:
                out.update(arch.attention_modules(i).values())
            if block.mlp.multiplies_out:
                out.update(arch.mlp_modules(i).values())
        return out

    def built_ranks(self, rank_config: RankConfig, arch: ModelArch) -> RankConfig:
        """The ranks the model is built with: those of ``rank_config`` minus the modules of
        blocks this plan builds dense (whose factors are multiplied out at load time)."""
        dropped = self.dense_modules(arch)
        kept = {n: r for n, r in rank_config.modules.items() if n not in dropped}
        return RankConfig.from_mapping(kept, arch) if kept else RankConfig.dense(arch)

    def to_json(self) -> list[dict[str, str]]:
        return [{"attention": b.attention.value, "mlp": b.mlp.value} for b in self.layers]

    def describe(self) -> str:
        """The per-block layouts in one line, as a log shows them: ``0 deinfer/naive, 1 dense/deinfer, ...``."""
        return ", ".join(f"{i} {b.attention.value}/{b.mlp.value}" for i, b in enumerate(self.layers))

    @classmethod
    def from_json(cls, doc: list[dict[str, str]], name: str) -> "LayoutPlan":
        return cls(tuple(BlockLayouts(Layout.parse(b["attention"]), Layout.parse(b["mlp"])) for b in doc), name)


def as_plan(layout: "Layout | LayoutPlan", num_layers: int) -> LayoutPlan:
    """``layout`` as a plan of ``num_layers`` layers (a ``Layout``: the uniform plan)."""
    if isinstance(layout, LayoutPlan):
        if len(layout.layers) != num_layers:
            raise ValueError(f"layout plan describes {len(layout.layers)} layers, the model has {num_layers}")
        return layout
    if not isinstance(layout, Layout):
        raise TypeError(f"a layout is a Layout or a LayoutPlan, not {layout!r} (planning.request parses names)")
    return LayoutPlan.uniform(layout, num_layers)
