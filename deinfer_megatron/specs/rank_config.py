"""The rank config: which matrices are decomposed, and at what rank.

On disk it is a JSON object mapping Hugging Face module names to integer ranks, e.g.
``{"model.layers.3.self_attn.q_proj": 64, "model.layers.3.mlp.down_proj": 256}``. A module
that is absent stays dense. Ranks may differ per matrix and per layer. Within one block
(attention: q, k, v, o; MLP: gate, up, down — or fc1, fc2) either every matrix is decomposed
or none: a block is one Megatron module whose layout is decided as a whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.arch.ranks import AttentionRanks, LayerRanks, MlpRanks
from deinfer_megatron.files.staging import write_atomic


@dataclass(frozen=True)
class RankConfig:
    """Validated ranks, by layer (0-based, global). ``modules`` keeps the Hugging Face names."""

    modules: Mapping[str, int]
    layers: tuple[LayerRanks, ...]

    @classmethod
    def dense(cls, arch: ModelArch) -> "RankConfig":
        return cls({}, tuple(LayerRanks(None, None) for _ in range(arch.num_layers)))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, object], arch: ModelArch, source: str = "rank config") -> "RankConfig":
        """Validate ``mapping`` against ``arch``; every error names the module and the fix."""
        if not isinstance(mapping, Mapping):
            raise ValueError(f"{source}: expected a JSON object of module name → rank")
        shapes = arch.linear_shapes()
        ranks: dict[str, int] = {}
        for name, rank in mapping.items():
            if name not in shapes:
                example = next(iter(shapes))
                raise ValueError(
                    f"{source}: unknown module '{name}'; names are Hugging Face linear modules "
                    f"of this model such as '{example}' (layers 0..{arch.num_layers - 1})"
                )
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise ValueError(f"{source}: rank of '{name}' must be an integer, got {rank!r}")
            out_f, in_f = shapes[name]
            if not 0 < rank <= min(out_f, in_f):
                raise ValueError(
                    f"{source}: rank {rank} of '{name}' must be in 1..{min(out_f, in_f)} "
                    f"(the matrix is {out_f}x{in_f})"
                )
            ranks[name] = rank
        layers = tuple(
            LayerRanks(_attention(arch, i, ranks, source), _mlp(arch, i, ranks, source))
            for i in range(arch.num_layers)
        )
        return cls(ranks, layers)

    @classmethod
    def load(cls, path: str | Path, arch: ModelArch) -> "RankConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"rank config {path} does not exist")
        try:
            mapping = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"rank config {path} is not valid JSON: {err}") from None
        return cls.from_mapping(mapping, arch, source=str(path))

    def save(self, path: str | Path) -> None:
        """Write the JSON mapping atomically (``files.staging.write_atomic``)."""
        write_atomic(Path(path), json.dumps(dict(self.modules), indent=1, sort_keys=True))


def _block(
    roles: Mapping[str, str], ranks: Mapping[str, int], source: str, what: str, layer: int
) -> dict[str, int] | None:
    present = {role: ranks[name] for role, name in roles.items() if name in ranks}
    if not present:
        return None
    if len(present) != len(roles):
        missing = [roles[r] for r in roles if r not in present]
        raise ValueError(
            f"{source}: layer {layer} {what} is partly decomposed; give ranks for all of "
            f"{', '.join(roles.values())} or none (missing: {', '.join(missing)})"
        )
    return present


def _attention(arch: ModelArch, layer: int, ranks: Mapping[str, int], source: str) -> AttentionRanks | None:
    got = _block(arch.attention_modules(layer), ranks, source, "attention", layer)
    return None if got is None else AttentionRanks(**got)


def _mlp(arch: ModelArch, layer: int, ranks: Mapping[str, int], source: str) -> MlpRanks | None:
    got = _block(arch.mlp_modules(layer), ranks, source, "MLP", layer)
    if got is None:
        return None
    if arch.gated:
        return MlpRanks((got["gate"], got["up"]), got["down"])
    return MlpRanks((got["fc1"],), got["fc2"])
