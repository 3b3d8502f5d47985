"""How many ranks each matrix gets under a parameter budget — or whether it stays dense.

``--ratio R`` keeps the fraction R of the original linear parameters of the chosen layers. A
matrix m×n kept at rank k costs k·(m+n) parameters; kept dense it costs m·n and loses nothing.
Beyond the break-even rank m·n/(m+n) the factors hold as many parameters as the dense matrix
while keeping only part of its spectrum (for a square matrix, half): accuracy lost for nothing,
and under DeInfer more communication and more parameters per rank than dense TP. So no
allocation here ever factors a matrix whose factors would hold ``BREAK_EVEN_FRACTION`` (99 %) of
its dense parameters or more: it stays dense, and its m·n counts in the budget.

Dense is decided per *block*, not per matrix: the rank config (specs/rank_config.py) and the
layers take a layer's attention (q, k, v, o) and its MLP (gate, up, down — or fc1, fc2) each as
one Megatron module, decomposed as a whole or dense as a whole (q/k/v share one merged V GEMM
and one all-gather, gate/up another).

* Uniform: every matrix gets ``k = R·m·n/(m+n)`` (at least 1, at most min(m, n)), so its factors
  hold ≈ R of its parameters. A block is kept dense when one of its matrices would reach the
  break-even share — for R < 0.99 that happens only by rounding on tiny matrices; for
  R ≥ 0.99 every block stays dense (there is nothing left to gain by factoring).
* Variadic (the SVD-LLM V2 idea): within each kind of matrix (all q projections, all down
  projections, ...) the budget goes, one rank at a time, to the matrix whose next singular
  direction removes the most truncation loss per parameter. Each matrix's curve ``loss[k]`` is
  known, and "dense" is simply its point k = min(m, n) at cost m·n and loss 0; for a block
  that move costs ``Σ (m·n − k·(m+n))`` over its matrices (taken from each one's kind budget)
  and removes ``Σ loss[k]``. The same greedy takes it when its loss removed per parameter beats
  every single rank step — which a block with flat spectra near break-even always does. The
  caller supplies comparable losses: the whitened output error of each matrix divided by the
  energy of the residual stream at its layer. Grouping the budget by kind keeps like with like;
  a floor keeps every matrix from collapsing. On SmolLM2 at ratio 0.8 this lowers the
  perplexity of uniform ranks (see docs/DECOMPOSITION.md).

``ALLOCATOR_VERSION`` is recorded in every decomposed folder's manifest; caches of decomposed
models (the demo's) are rebuilt when it changes.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Mapping, Sequence

import torch

from deinfer_megatron.arch.model import ModelArch

VARIADIC_FLOOR = 0.25  # no decomposed matrix gets less than this fraction of its uniform rank
BREAK_EVEN_FRACTION = 0.99  # factors holding this share of m·n or more: the matrix stays dense
ALLOCATOR_VERSION = 2  # 1: break-even matrices factored; 2: they stay dense

Shapes = Mapping[str, tuple[int, int]]


def check_ratio(ratio: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"--ratio must be in (0, 1] (the fraction of linear parameters kept), got {ratio}")


def uniform_rank(out_features: int, in_features: int, ratio: float) -> int:
    """The rank that keeps ``ratio`` of an out×in matrix's parameters (before the dense rule)."""
    check_ratio(ratio)
    k = round(ratio * out_features * in_features / (out_features + in_features))
    return max(1, min(k, out_features, in_features))


def factor_ceiling(out_features: int, in_features: int) -> int:
    """The highest rank at which the factors hold less than ``BREAK_EVEN_FRACTION`` of the dense
    parameters (0 when even rank 1 does not)."""
    m, n = out_features, in_features
    k = min(m, n, int(BREAK_EVEN_FRACTION * m * n // (m + n)))
    while k > 0 and k * (m + n) >= BREAK_EVEN_FRACTION * m * n:
        k -= 1
    return k


def layer_of(arch: ModelArch, name: str) -> int:
    return int(name[len(arch.layer_prefix) + 1 :].split(".")[0])


def blocks(arch: ModelArch, names: Iterable[str]) -> list[tuple[str, ...]]:
    """The matrices of ``names`` grouped by block (one layer's attention; one layer's MLP), in
    layer order: each block is decomposed as a whole or kept dense as a whole."""
    wanted = set(names)
    out = []
    for layer in range(arch.num_layers):
        for roles in (arch.attention_modules(layer), arch.mlp_modules(layer)):
            block = tuple(n for n in roles.values() if n in wanted)
            if block:
                out.append(block)
    return out


def uniform_ranks(arch: ModelArch, ratio: float, layers: Iterable[int] | None = None) -> dict[str, int]:
    """Uniform ranks for every decomposable matrix of the chosen layers (all by default); a
    block at the break-even share stays dense (absent from the result)."""
    keep = set(range(arch.num_layers) if layers is None else layers)
    shapes = {n: s for n, s in arch.linear_shapes().items() if layer_of(arch, n) in keep}
    return uniform_allocation(shapes, blocks(arch, shapes), ratio)


def uniform_allocation(shapes: Shapes, groups: Sequence[Sequence[str]], ratio: float) -> dict[str, int]:
    """``uniform_rank`` for every matrix of ``groups`` (its blocks), except blocks in which a
    matrix's factors would hold the break-even share of its parameters: those stay dense."""
    ranks = {}
    for block in groups:
        got = {n: uniform_rank(*shapes[n], ratio) for n in block}
        if all(got[n] <= factor_ceiling(*shapes[n]) for n in block):
            ranks.update(got)
    return ranks


def matrix_kind(name: str) -> str:
    """``model.layers.3.mlp.down_proj`` → ``mlp.down_proj``: matrices of one kind, any layer."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[i + 1 :])
    return name


def variadic_ranks(
    losses: Mapping[str, torch.Tensor],
    shapes: Shapes,
    ratio: float,
    groups: Sequence[Sequence[str]] | None = None,
) -> dict[str, int]:
    """Ranks under the uniform rule's parameter budget, allocated greedily by truncation loss,
    with "dense" as one more move per block. Matrices of dense blocks are absent from the result.

    Args:
        losses: per matrix, ``loss[k]`` = error of keeping rank k (k = 0..min(m, n)),
            non-increasing, comparable across the matrices of one kind.
        shapes: per matrix, (out, in).
        ratio: fraction of the linear parameters kept; each kind's budget is the parameters its
            matrices would hold at their uniform ranks.
        groups: the blocks (each decomposed or dense as a whole); default: each matrix alone.
    """
    check_ratio(ratio)
    names = list(losses)
    groups = [tuple(b) for b in groups] if groups is not None else [(n,) for n in names]
    block_of = {n: i for i, b in enumerate(groups) for n in b}
    if set(block_of) != set(names):
        raise ValueError("variadic_ranks: the blocks must cover exactly the matrices that have losses")
    kind = {n: matrix_kind(n) for n in names}
    cost = {n: sum(shapes[n]) for n in names}
    dense_cost = {n: shapes[n][0] * shapes[n][1] for n in names}
    ceiling = {n: factor_ceiling(*shapes[n]) for n in names}
    curve = {n: losses[n].double().tolist() for n in names}
    budget: dict[str, int] = {}
    for n in names:
        budget[kind[n]] = budget.get(kind[n], 0) + uniform_rank(*shapes[n], ratio) * cost[n]
    ranks = {n: max(1, int(VARIADIC_FLOOR * uniform_rank(*shapes[n], ratio))) for n in names}
    for n in names:
        budget[kind[n]] -= min(ranks[n], ceiling[n]) * cost[n]
    dense: set[int] = set()
    version = [0] * len(groups)  # a block's dense move is re-priced whenever one of its ranks grows
    heap: list[tuple[float, int, tuple]] = []  # (-loss removed per parameter, order, move)
    order = iter(range(1 << 62))  # ties go to the move offered first; moves are never compared

    def dense_move(b: int) -> tuple[float, dict[str, int]]:
        """(loss removed per parameter, parameters taken from each kind) of making block b dense."""
        extra: dict[str, int] = {}
        gain = 0.0
        for n in groups[b]:
            k = min(ranks[n], ceiling[n])
            extra[kind[n]] = extra.get(kind[n], 0) + dense_cost[n] - k * cost[n]
            gain += curve[n][k]
        return gain / max(sum(extra.values()), 1), extra

    def make_dense(b: int, extra: dict[str, int]) -> None:
        for kd, spent in extra.items():
            budget[kd] -= spent
        dense.add(b)

    def offer_rank(n: str) -> None:
        k = ranks[n]
        if k < ceiling[n]:
            heapq.heappush(heap, (-(curve[n][k] - curve[n][k + 1]) / cost[n], next(order), ("rank", n)))

    def offer_dense(b: int) -> None:
        heapq.heappush(heap, (-dense_move(b)[0], next(order), ("dense", b, version[b])))

    for b, block in enumerate(groups):
        if any(ranks[n] > ceiling[n] for n in block):  # not even its floor fits below break-even
            make_dense(b, dense_move(b)[1])
            continue
        offer_dense(b)
        for n in block:
            offer_rank(n)
    while heap:
        move = heapq.heappop(heap)[2]
        if move[0] == "dense":
            _, b, stamp = move
            if b in dense or stamp != version[b]:
                continue  # taken already, or re-priced since
            extra = dense_move(b)[1]
            if all(extra[kd] <= budget[kd] for kd in extra):
                make_dense(b, extra)
            continue  # if it did not fit, a later rank step in the block offers it again
        n = move[1]
        b = block_of[n]
        if b in dense or cost[n] > budget[kind[n]]:
            continue  # dense already; or this matrix no longer fits (a narrower one of the kind might)
        ranks[n] += 1
        budget[kind[n]] -= cost[n]
        version[b] += 1
        offer_rank(n)
        offer_dense(b)
    return {n: ranks[n] for n in names if block_of[n] not in dense}
