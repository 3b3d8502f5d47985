"""How many ranks each matrix gets under a parameter budget.

``--ratio R`` keeps the fraction R of the original linear parameters: a matrix m×n kept at rank
k costs k·(m+n) parameters instead of m·n, so the uniform rule gives each matrix
``k = R·m·n/(m+n)`` (at least 1, at most min(m, n)).
"""

from __future__ import annotations

from typing import Iterable

from deinfer_megatron.models.arch import ModelArch


def check_ratio(ratio: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"--ratio must be in (0, 1] (the fraction of linear parameters kept), got {ratio}")


def uniform_rank(out_features: int, in_features: int, ratio: float) -> int:
    """The rank that keeps ``ratio`` of an out×in matrix's parameters."""
    check_ratio(ratio)
    k = round(ratio * out_features * in_features / (out_features + in_features))
    return max(1, min(k, out_features, in_features))


def uniform_ranks(arch: ModelArch, ratio: float, layers: Iterable[int] | None = None) -> dict[str, int]:
    """Uniform ranks for every decomposable matrix of the chosen layers (all by default)."""
    keep = set(range(arch.num_layers) if layers is None else layers)
    prefix = arch.layer_prefix + "."
    out = {}
    for name, (m, n) in arch.linear_shapes().items():
        if int(name[len(prefix):].split(".")[0]) in keep:
            out[name] = uniform_rank(m, n, ratio)
    return out
