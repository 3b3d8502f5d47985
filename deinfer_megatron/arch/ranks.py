"""The ranks of one layer's decomposed blocks, as the layers and the rank config see them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionRanks:
    """Ranks of the four decomposed attention matrices of one layer."""

    q: int
    k: int
    v: int
    o: int


@dataclass(frozen=True)
class MlpRanks:
    """Ranks of one MLP: ``up_sections`` are the fc1 sections (gate, up) or (fc1,)."""

    up_sections: tuple[int, ...]
    down: int


@dataclass(frozen=True)
class LayerRanks:
    """One layer: each block decomposed (its ranks) or dense (None)."""

    attention: AttentionRanks | None
    mlp: MlpRanks | None

    @property
    def decomposed(self) -> bool:
        return self.attention is not None or self.mlp is not None
