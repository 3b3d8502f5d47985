"""The model a bench runs, as folders that the ranks open themselves.

A synthetic model is drawn once in the parent and written to a temporary folder, decomposed at
uniform ranks, plus a second folder with the same factors multiplied out for the dense layout.
Ranks then read only their own shards through mmap, as with a real folder, so a rank's peak
RSS is its share of the model and not a full random state. Multiplying out in the parent
(float32, once) also spares every dense cell from doing it in double precision on every rank
(the loader's way, which is minutes at 1B shapes).

A real folder is used as it is: a decomposed folder runs every layout (the dense layout
multiplies its factors out at load time); a dense folder runs the dense layout only, since
decomposing is ``deinfer-megatron decompose``'s job, not the bench's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from deinfer_megatron.arch.model import ModelArch, arch_from_hf_config
from deinfer_megatron.checkpoints.folder import open_model, write_decomposed
from deinfer_megatron.decompose.allocation import uniform_ranks
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.models.synthetic import random_state, synthetic_config
from deinfer_megatron.planning.request import LayoutRequest
from deinfer_megatron.specs.layout import LayoutPlan, latent_cache_layouts
from deinfer_megatron.specs.rank_config import RankConfig


@dataclass(frozen=True)
class ModelSource:
    """What the cells load: a name for reports, the architecture, and the folders."""

    name: str
    arch: ModelArch
    rank_config: RankConfig  # of the decomposed folder; all dense when there is none
    decomposed_dir: Path | None
    dense_dir: Path  # what the dense layout loads (a decomposed folder is multiplied out)

    @property
    def folder(self) -> Path:
        """The folder a cell is prepared from: the decomposed one where there is one (``auto``
        and the factored layouts need its ranks)."""
        return self.decomposed_dir if self.decomposed_dir is not None else self.dense_dir

    def folder_for(self, plan: LayoutPlan) -> Path:
        """The folder a cell's ranks load for ``plan``: the multiplied-out one when every block
        is dense (multiplied out once, here, rather than on every rank)."""
        return self.dense_dir if plan.multiplies_out else self.folder

    def skip_reason(self, request: LayoutRequest, kv_cache: CacheKind) -> str | None:
        """Why a (layout, KV cache) pair does not apply to this model; None when it does."""
        if request.is_auto:
            if kv_cache is CacheKind.LATENT and self.decomposed_dir is None:
                return f"{self.name} is a dense folder; the latent KV cache needs a decomposed one"
            return None
        layout = request.fixed
        if not layout.multiplies_out and self.decomposed_dir is None:
            return (f"{self.name} is a dense folder; the {layout.value} layout needs a decomposed one "
                    "(make it with `deinfer-megatron decompose`)")
        if kv_cache is CacheKind.LATENT and not layout.supports_latent_cache:
            return f"the latent KV cache applies to the {latent_cache_layouts()} layout only"
        return None

    def describe(self) -> dict:
        """The document's ``model``: its shape, and whether (and how much of) it is decomposed."""
        a = self.arch
        return {"name": self.name, "family": a.family, "layers": a.num_layers, "hidden": a.hidden_size,
                "intermediate": a.ffn_hidden_size, "heads": a.num_heads, "kv_heads": a.num_kv_heads,
                "head_dim": a.head_dim, "vocab": a.vocab_size, "decomposed": self.decomposed_dir is not None,
                "decomposed_modules": len(self.rank_config.modules)}


def folder_source(path: Path) -> ModelSource:
    """A real model folder (manifest verified here, once; the ranks skip the check)."""

    folder = open_model(path)
    return ModelSource(str(path), folder.arch, folder.rank_config,
                       path if folder.decomposed else None, path)


def _multiplied_out(state: dict[str, torch.Tensor], modules: list[str]) -> dict[str, torch.Tensor]:
    dense = {k: v for k, v in state.items() if k.rpartition(".")[0] not in modules}
    for module in modules:
        dense[f"{module}.weight"] = state[f"{module}.u"] @ state[f"{module}.v"]
    return dense


def synthetic_source(name: str, ratio: float, seed: int, workdir: Path) -> ModelSource:
    """Draw the synthetic model ``name`` (every layer decomposed at ``ratio``) into ``workdir``."""

    config = synthetic_config(name)
    arch = arch_from_hf_config(config)
    ranks = uniform_ranks(arch, ratio)
    rank_config = RankConfig.from_mapping(ranks, arch)
    state = random_state(arch, ranks, seed=seed)
    meta = {"source": f"synthetic {name}", "ratio": ratio, "seed": seed}
    dec = write_decomposed(workdir / f"{name}-r{ratio:g}", config=config, tensors=state,
                           rank_config=rank_config, tokenizer_dir=None, metadata=meta)
    dense_state = _multiplied_out(state, list(ranks))
    del state
    dense = write_decomposed(workdir / f"{name}-r{ratio:g}-multiplied", config=config, tensors=dense_state,
                             rank_config=RankConfig.dense(arch), tokenizer_dir=None, metadata=meta)
    return ModelSource(f"{name} (ratio {ratio:g})", arch, rank_config, dec, dense)
