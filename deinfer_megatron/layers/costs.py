"""What a layer costs one rank — parameters held, collectives issued — without building it.

Every layer class answers for itself from its constructor arguments and a ``TPView``
(``cost(...)`` class methods next to the code that allocates and communicates), so the planner
walks a model's layers and adds up their answers instead of re-deriving each layout's
formulas. This module holds only the value those methods return.

A collective is counted in the unit of the communication ledger (``parallel.comm``): elements
per token of the gathered, reduced or reduce-scattered tensor. A cost lists the forward pass's
collectives and, apart, those of the backward pass (the adjoints, ``parallel.comm``'s table),
so that a training step's communication is planned from the same classes. A collective over a group of one rank is never
issued (``comm`` returns its input), so a cost lists none at TP 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from deinfer_megatron.parallel.topology import TPView


class Gemm(NamedTuple):
    """One matrix product a rank runs per forward, at the shape its shard has: ``rows × k`` input
    by a ``k × n`` weight (``count`` of them side by side as one ``bmm`` for merged sections).
    ``transposed``: the weight is stored ``(n, k)`` and applied by ``F.linear`` (Megatron's
    dense layers), not input-major ``(k, n)`` as the factors store theirs — BLAS streams the two
    at different speeds, so the cost model times each as it is run."""

    k: int
    n: int
    count: int = 1
    transposed: bool = False

    @property
    def weights(self) -> int:
        return self.count * self.k * self.n


class Attend(NamedTuple):
    """One rank's attention of a decode token over its cached keys: which core runs it
    (``core``: the name its module answers to, ``layers.core_attention.CORES``) over how many
    query and KV heads of ``head_dim``. The cost model times each at the job's batch and context
    (``calibrate.measure_attention``): the cores differ several-fold at one size (Megatron's
    unfused ``DotProductAttention`` copies K/V per query head and softmaxes in its own kernels).
    ``rotary``: the block applies RoPE to every cached key at every step before attending —
    Megatron's static-batching ``SelfAttention`` caches keys before RoPE (only its GPU-only
    ``flash_decode`` path rotates them once), which costs about as much as its core does."""

    core: str
    heads: int
    kv_heads: int
    head_dim: int
    rotary: bool = False


class Collective(NamedTuple):
    """One collective per token: its kind and element count, as the ledger records them."""

    kind: str  # "all_gather" | "all_reduce" | "reduce_scatter"
    elements: int


@dataclass(frozen=True)
class Cost:
    """What one rank holds and sends for one layer (or a sum of layers).

    Attributes:
        params: parameter elements this rank allocates.
        collectives: the collectives this rank issues per token in the forward pass, in the
            order it issues them.
        kv_heads: KV heads whose K/V this rank caches (attention blocks; 0 for everything else).
        backward: the collectives the backward pass of the activations issues per token,
            listed in the forward order of the operations they are the adjoints of (the
            backward pass issues them in the reverse of this order).
        gemms: the matrix products this rank runs, at its shard's shapes, in forward order
            (what ``planning.cost_model`` prices, one measured shape each).
        attends: the attention over cached tokens this rank runs per decode token (attention
            blocks), priced per context by the cost model.
    """

    params: int = 0
    collectives: tuple[Collective, ...] = ()
    kv_heads: int = 0
    backward: tuple[Collective, ...] = ()
    gemms: tuple[Gemm, ...] = ()
    attends: tuple[Attend, ...] = ()

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(
            self.params + other.params,
            self.collectives + other.collectives,
            self.kv_heads + other.kv_heads,
            self.backward + other.backward,
            self.gemms + other.gemms,
            self.attends + other.attends,
        )


def issued(tp: TPView, *collectives: Collective) -> tuple[Collective, ...]:
    """``collectives`` as a rank of ``tp`` issues them: none on a group of one rank."""
    return collectives if tp.size > 1 else ()


def numel(shape: tuple[int, ...] | None) -> int:
    """Elements of a parameter of ``shape`` (0 for an absent one, such as no bias)."""
    if shape is None:
        return 0
    n = 1
    for s in shape:
        n *= s
    return n
