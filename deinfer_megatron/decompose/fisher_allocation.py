"""``--allocation fisher``: ranks that minimise the predicted end-to-end loss under one budget.

Each matrix m has a truncation-loss curve ``loss_m[k]`` on the calibration data (its output
error at rank k) and a sensitivity ``α_m`` (decompose/sensitivity.py), so ``α_m · loss_m[k]``
predicts what rank k costs the model as a whole (½ of it: the KL to the dense model), in one
currency for every matrix. The allocation solves

    minimise  Σ_m α_m · loss_m[k_m]   subject to   Σ_m cost_m ≤ B,

with cost k·(m+n) for a factored matrix and m·n for one kept dense (dense is decided per block,
as in decompose/allocation.py: a layer's attention, or its MLP), ``k`` between the variadic
floor and the break-even ceiling, and one budget B for all matrices: the uniform rule's total,
Σ uniform_rank·(m+n). Unlike ``variadic``, parameters move between kinds of matrix (from the k
projections to the down projections, say) wherever the predicted loss says so.

For a fixed set D of dense blocks the rest is a knapsack with one item per rank step whose
values, the singular values squared, fall with k: taking the steps in order of loss removed per
parameter until none fits (``_Steps.fill``) is optimal up to the last step. The set D is where
the problem is not convex. It starts as the one the variadic greedy picks (its dense moves, in
one pool), then a local search flips one block at a time — dense, or factored again — and keeps
the best flip while one lowers the predicted loss. On random curves this reaches the exhaustive
optimum (tests/decompose/test_allocation.py).

What is left of the budget is less than one more rank step of every matrix still below its
ceiling; matrices of dense blocks are absent from the result.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from deinfer_megatron.decompose.allocation import (
    VARIADIC_FLOOR, Shapes, check_ratio, factor_ceiling, one_pool, uniform_rank, variadic_ranks,
)

MAX_FLIPS = 1000  # a bound on the local search; each accepted flip lowers the loss


def fisher_ranks(
    losses: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    shapes: Shapes,
    ratio: float,
    groups: Sequence[Sequence[str]] | None = None,
) -> dict[str, int]:
    """Ranks minimising ``Σ_m weights[m] · losses[m][k_m]`` under the uniform rule's total
    budget (module docstring).

    Args:
        losses: per matrix, ``loss[k]`` for k = 0..min(m, n), non-increasing.
        weights: per matrix, its sensitivity α (≥ 0).
        shapes: per matrix, (out, in).
        ratio: fraction of the linear parameters kept.
        groups: the blocks (each decomposed or dense as a whole); default: each matrix alone.
    """
    check_ratio(ratio)
    if set(weights) != set(losses):
        raise ValueError("fisher_ranks: every matrix with a loss curve needs a sensitivity weight")
    groups = [tuple(b) for b in groups] if groups is not None else [(n,) for n in losses]
    scaled = {n: losses[n].double() * float(weights[n]) for n in losses}
    steps = _Steps(scaled, shapes, ratio, groups)
    start = variadic_ranks(scaled, shapes, ratio, groups, pool=one_pool)
    dense = frozenset(b for b, block in enumerate(groups) if block[0] not in start)
    best = steps.fill(dense)
    assert best is not None, "the variadic greedy's dense blocks fit the budget"
    free = [b for b in range(len(groups)) if b not in steps.forced]
    for _ in range(MAX_FLIPS):
        moves = [dense ^ {b} for b in free]  # one block flipped
        moves += [dense - {a} | {b} for a in dense - steps.forced for b in free if b not in dense]  # one swapped
        better = min((t for t in map(steps.fill, moves) if t is not None), key=lambda t: t[0], default=None)
        if better is None or better[0] >= best[0] * (1 - 1e-12):
            break
        best, dense = better, better[2]
    return steps.ranks(best)


class _Steps:
    """Every rank step of every matrix (from its floor to its ceiling), sorted by loss removed per
    parameter — the order in which a greedy fill takes them."""

    def __init__(self, curves: Mapping[str, torch.Tensor], shapes: Shapes, ratio: float,
                 groups: list[tuple[str, ...]]) -> None:
        self.names = list(curves)
        index = {n: i for i, n in enumerate(self.names)}
        self.groups = [[index[n] for n in block] for block in groups]
        if sorted(i for block in self.groups for i in block) != list(range(len(self.names))):
            raise ValueError("fisher_ranks: the blocks must cover exactly the matrices that have losses")
        width = max(len(curves[n]) for n in self.names) if self.names else 1
        self.curves = np.zeros((len(self.names), width))  # row i: matrix i's curve, padded with its last value
        for i, n in enumerate(self.names):
            c = curves[n].double().numpy()
            self.curves[i, :len(c)], self.curves[i, len(c):] = c, c[-1]
        self.cost = np.array([sum(shapes[n]) for n in self.names], dtype=np.int64)
        self.dense_cost = np.array([shapes[n][0] * shapes[n][1] for n in self.names], dtype=np.int64)
        self.budget = int(sum(uniform_rank(*shapes[n], ratio) * sum(shapes[n]) for n in self.names))
        ceiling = [factor_ceiling(*shapes[n]) for n in self.names]
        self.floor = np.array([max(1, int(VARIADIC_FLOOR * uniform_rank(*shapes[n], ratio))) for n in self.names])
        # blocks in which even the floor reaches break-even can only be dense
        self.forced = frozenset(b for b, block in enumerate(self.groups)
                                if any(self.floor[i] > ceiling[i] for i in block))
        matrix, gain = [], []
        for i, curve in enumerate(self.curves):
            ks = np.arange(self.floor[i], max(ceiling[i], self.floor[i]))
            matrix.append(np.full(len(ks), i))
            gain.append((curve[ks] - curve[ks + 1]) / self.cost[i])
        matrix_of = np.concatenate(matrix) if matrix else np.zeros(0, dtype=np.int64)
        order = np.argsort(-np.concatenate(gain) if gain else np.zeros(0), kind="stable")  # a matrix's steps keep their order
        self.step_matrix = matrix_of[order]
        self.step_cost = self.cost[self.step_matrix]

    def ranks(self, fill: tuple[float, np.ndarray, frozenset[int]]) -> dict[str, int]:
        """The rank of every factored matrix of a ``fill``."""
        _, ranks, dense = fill
        is_dense = self._dense_mask(dense)
        return {n: int(ranks[i]) for i, n in enumerate(self.names) if not is_dense[i]}

    def _dense_mask(self, dense: frozenset[int]) -> np.ndarray:
        is_dense = np.zeros(len(self.names), dtype=bool)
        for b in dense:
            is_dense[self.groups[b]] = True
        return is_dense

    def fill(self, dense: frozenset[int]) -> tuple[float, np.ndarray, frozenset[int]] | None:
        """(predicted loss, rank per matrix, dense) of the best fill with exactly the blocks
        ``dense`` kept dense (and the forced ones), or None when those do not fit the budget."""
        dense = dense | self.forced
        is_dense = self._dense_mask(dense)
        left = self.budget - int(self.dense_cost[is_dense].sum()) - int((self.floor * self.cost)[~is_dense].sum())
        if left < 0:
            return None
        live = ~is_dense[self.step_matrix]
        matrices, costs = self.step_matrix[live], self.step_cost[live]
        spent = np.cumsum(costs)
        cut = int(np.searchsorted(spent, left, side="right"))  # every step before cut fits
        taken = [matrices[:cut]]
        left -= int(spent[cut - 1]) if cut else 0
        cheapest = int(costs.min()) if len(costs) else 0
        skipped = np.zeros(len(self.names), dtype=bool)  # a matrix whose step no longer fits: its later ones neither
        extra = []
        for i, c in zip(matrices[cut:].tolist(), costs[cut:].tolist()):
            if left < cheapest:
                break
            if not skipped[i] and c <= left:
                extra.append(i)
                left -= c
            else:
                skipped[i] = True
        counts = np.bincount(np.concatenate(taken + [np.array(extra, dtype=np.int64)]), minlength=len(self.names))
        ranks = self.floor + counts
        loss = float(self.curves[np.arange(len(ranks)), ranks][~is_dense].sum())
        return loss, ranks, frozenset(dense)
