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
  every single rank step — which a block with flat spectra near break-even always does. A
  greedy fill can end with a block walked up to its ceilings whose dense move misses its budget
  by a few parameters; a last pass makes it dense by giving back the cheapest rank steps of the
  same kinds elsewhere, when they lose less than the block still loses (then fills again). On
  random curves this is the exhaustive optimum in almost every case (tests). The
  caller supplies comparable losses: the whitened output error of each matrix divided by the
  energy of the residual stream at its layer. Grouping the budget by kind keeps like with like;
  a floor keeps every matrix from collapsing (see docs/DECOMPOSITION.md for what it gains on
  SmolLM2).

* Fisher (decompose/fisher_allocation.py): one budget for every kind, the truncation losses
  weighted by each matrix's measured end-to-end sensitivity; it starts from this module's greedy
  in one pool (``one_pool``) and searches the set of dense blocks.

``ALLOCATOR_VERSION`` is recorded in every decomposed folder's manifest; caches of decomposed
models (the demo's) are rebuilt when it changes.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable, Mapping, Sequence

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
    if ratio >= BREAK_EVEN_FRACTION:  # every matrix's factors would hold ~ its dense parameters
        return {}
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


def one_pool(name: str) -> str:
    """Every matrix draws on one budget (``fisher_ranks``)."""
    return "all"


def variadic_ranks(
    losses: Mapping[str, torch.Tensor],
    shapes: Shapes,
    ratio: float,
    groups: Sequence[Sequence[str]] | None = None,
    pool: Callable[[str], str] = matrix_kind,
) -> dict[str, int]:
    """Ranks under the uniform rule's parameter budget, allocated greedily by truncation loss,
    with "dense" as one more move per block. Matrices of dense blocks are absent from the result.

    Args:
        losses: per matrix, ``loss[k]`` = error of keeping rank k (k = 0..min(m, n)),
            non-increasing, comparable across the matrices of one pool.
        shapes: per matrix, (out, in).
        ratio: fraction of the linear parameters kept; each pool's budget is the parameters its
            matrices would hold at their uniform ranks.
        groups: the blocks (each decomposed or dense as a whole); default: each matrix alone.
        pool: the budget a matrix draws on — its kind (default), or ``one_pool``.
    """
    check_ratio(ratio)
    groups = [tuple(b) for b in groups] if groups is not None else [(n,) for n in losses]
    state = _Greedy(losses, shapes, ratio, groups, pool)
    state.fill()
    state.swap_in_dense_blocks()
    state.fill()  # what the swaps left over
    return state.result()


class _Greedy:
    """The state of the variadic allocation: ranks, dense blocks, what each kind has left.

    ``fill`` is the greedy: the move removing the most loss per parameter first, a rank step of
    one matrix or the dense move of one block, while it fits its kinds' budgets. Greedy fills
    can end with a block walked up to its ceilings whose dense move no longer fits by a few
    parameters; ``swap_in_dense_blocks`` then frees the parameters by taking back the cheapest
    rank steps of the same kinds elsewhere, when that loses less than the dense move removes.
    """

    def __init__(self, losses: Mapping[str, torch.Tensor], shapes: Shapes, ratio: float,
                 groups: list[tuple[str, ...]], pool: Callable[[str], str] = matrix_kind) -> None:
        names = list(losses)
        self.groups = groups
        self.block_of = {n: i for i, b in enumerate(groups) for n in b}
        if set(self.block_of) != set(names):
            raise ValueError("variadic_ranks: the blocks must cover exactly the matrices that have losses")
        self.kind = {n: pool(n) for n in names}  # the budget each matrix draws on
        self.cost = {n: sum(shapes[n]) for n in names}
        self.dense_cost = {n: shapes[n][0] * shapes[n][1] for n in names}
        self.ceiling = {n: factor_ceiling(*shapes[n]) for n in names}
        self.curve = {n: losses[n].double().tolist() for n in names}
        self.budget: dict[str, int] = {}
        for n in names:
            self.budget[self.kind[n]] = self.budget.get(self.kind[n], 0) + uniform_rank(*shapes[n], ratio) * self.cost[n]
        self.floor = {n: max(1, int(VARIADIC_FLOOR * uniform_rank(*shapes[n], ratio))) for n in names}
        self.ranks = dict(self.floor)
        for n in names:
            self.budget[self.kind[n]] -= min(self.ranks[n], self.ceiling[n]) * self.cost[n]
        self.dense: set[int] = set()
        for b, block in enumerate(groups):
            if any(self.ranks[n] > self.ceiling[n] for n in block):  # even the floor reaches break-even
                self.make_dense(b, self.dense_move(b)[1])

    def result(self) -> dict[str, int]:
        return {n: k for n, k in self.ranks.items() if self.block_of[n] not in self.dense}

    def dense_move(self, b: int) -> tuple[float, dict[str, int]]:
        """(loss removed, parameters taken from each kind) by making block b dense."""
        extra: dict[str, int] = {}
        gain = 0.0
        for n in self.groups[b]:
            k = min(self.ranks[n], self.ceiling[n])
            extra[self.kind[n]] = extra.get(self.kind[n], 0) + self.dense_cost[n] - k * self.cost[n]
            gain += self.curve[n][k]
        return gain, extra

    def make_dense(self, b: int, extra: Mapping[str, int]) -> None:
        for kind, spent in extra.items():
            self.budget[kind] -= spent
        self.dense.add(b)

    def fill(self) -> None:
        version = [0] * len(self.groups)  # a block's dense move is re-priced when one of its ranks grows
        heap: list[tuple[float, int, tuple]] = []  # (-loss removed per parameter, order, move)
        order = iter(range(1 << 62))  # ties go to the move offered first; moves are never compared
        curve, cost, ranks = self.curve, self.cost, self.ranks

        def offer_rank(n: str) -> None:
            k = ranks[n]
            if k < self.ceiling[n]:
                heapq.heappush(heap, (-(curve[n][k] - curve[n][k + 1]) / cost[n], next(order), ("rank", n)))

        def offer_dense(b: int) -> None:
            gain, extra = self.dense_move(b)
            heapq.heappush(heap, (-gain / max(sum(extra.values()), 1), next(order), ("dense", b, version[b])))

        for b, block in enumerate(self.groups):
            if b not in self.dense:
                offer_dense(b)
                for n in block:
                    offer_rank(n)
        while heap:
            move = heapq.heappop(heap)[2]
            if move[0] == "dense":
                _, b, stamp = move
                if b in self.dense or stamp != version[b]:
                    continue  # taken already, or re-priced since
                extra = self.dense_move(b)[1]
                if all(extra[kind] <= self.budget[kind] for kind in extra):
                    self.make_dense(b, extra)
                continue  # if it did not fit, a later rank step in the block offers it again
            n = move[1]
            b = self.block_of[n]
            if b in self.dense or cost[n] > self.budget[self.kind[n]]:
                continue  # dense already; or this matrix no longer fits (a narrower one of the kind might)
            ranks[n] += 1
            self.budget[self.kind[n]] -= cost[n]
            version[b] += 1
            offer_rank(n)
            offer_dense(b)

    def swap_in_dense_blocks(self) -> None:
        """Make a block dense by taking back rank steps of its kinds in other blocks, whenever the
        steps given back lose less than the block's remaining loss; best blocks first."""
        live = [b for b in range(len(self.groups)) if b not in self.dense]
        ratio = {b: self.dense_move(b)[0] / max(sum(self.dense_move(b)[1].values()), 1) for b in live}
        for b in sorted(live, key=lambda b: -ratio[b]):
            if b in self.dense:
                continue
            gain, extra = self.dense_move(b)
            taken: dict[str, int] = {}
            lost = 0.0
            for kind, need in extra.items():
                freed, loss = self._give_back(kind, need - self.budget[kind], exclude=b, dry=True)
                if freed < need - self.budget[kind]:
                    lost = float("inf")
                    break
                taken[kind], lost = need - self.budget[kind], lost + loss
            if lost < gain:
                for kind, deficit in taken.items():
                    self._give_back(kind, deficit, exclude=b, dry=False)
                self.make_dense(b, extra)

    def _give_back(self, kind: str, deficit: int, exclude: int, dry: bool) -> tuple[int, float]:
        """Free at least ``deficit`` parameters of ``kind`` by undoing its cheapest rank steps (not
        below the floors, not in block ``exclude`` or dense blocks); returns (freed, loss added)."""
        if deficit <= 0:
            return 0, 0.0
        ranks = dict(self.ranks) if dry else self.ranks
        heap = []
        for n, k in ranks.items():
            if self.kind[n] == kind and self.block_of[n] != exclude and self.block_of[n] not in self.dense \
                    and k > self.floor[n]:
                heap.append((self.curve[n][k - 1] - self.curve[n][k], n))
        heapq.heapify(heap)
        freed, lost = 0, 0.0
        while heap and freed < deficit:
            loss, n = heapq.heappop(heap)
            ranks[n] -= 1
            freed += self.cost[n]
            lost += loss
            k = ranks[n]
            if k > self.floor[n]:
                heapq.heappush(heap, (self.curve[n][k - 1] - self.curve[n][k], n))
        if not dry:
            self.budget[kind] += freed
        return freed, lost
