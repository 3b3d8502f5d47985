"""Build one pipeline stage of a (decomposed) ``GPTModel`` and load it.

The stage is constructed on the meta device and then given empty local storage
(``to_empty``) on the device the job runs on (``ParallelGroups.device``: this rank's GPU under
NCCL, else the CPU): only this rank's shards are ever allocated, and the checkpoint loaders fill
them. Megatron's ``GPTModel`` is used as is; only the decoder-block spec is ours.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from deinfer_megatron.checkpoints.loader import MultipliedOut, load_stage
from deinfer_megatron.arch.model import ModelArch, transformer_config
from deinfer_megatron.checkpoints.dist_checkpoint import (
    is_dist_checkpoint,
    iteration_dir,
    load_model_state,
    open_checkpoint,
)
from deinfer_megatron.checkpoints.folder import open_model
from deinfer_megatron.parallel.runtime import ParallelGroups
from deinfer_megatron.specs.builder import decomposed_block_spec
from deinfer_megatron.specs.layout import Layout, LayoutPlan, as_plan
from deinfer_megatron.specs.rank_config import RankConfig


@dataclass(frozen=True)
class Stage:
    """One rank's piece of the model: its ``GPTModel`` stage and where it sits."""

    model: Any  # megatron.core.models.gpt.GPTModel
    arch: ModelArch
    layout: LayoutPlan
    rank_config: RankConfig  # as built (without the modules of blocks built dense)
    groups: ParallelGroups
    layer_offset: int
    num_local_layers: int
    padded_vocab: int
    runner: Any = None  # what forward calls go through when not the model itself (an engine)

    @property
    def device(self) -> torch.device:
        """Where the stage's parameters, inputs and pipeline buffers live."""
        return self.groups.device

    @property
    def driver(self) -> Any:
        """What forward calls go through: the engine around the model, or the model itself."""
        return self.runner if self.runner is not None else self.model

    def with_runner(self, runner: Any) -> "Stage":
        """The same stage driven through ``runner`` (an inference engine wrapping ``model``)."""
        return replace(self, runner=runner)


def padded_vocab_size(vocab: int, tp: int) -> int:
    """Megatron splits the vocabulary evenly; pad with zero rows up to a multiple of TP."""
    return -(-vocab // tp) * tp


# What Megatron's grad-norm, clipping, DDP and optimizer read off a parameter.
_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
                     "allreduce", "shared", "shared_embedding")


def _to_empty_keeping_attributes(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)``, keeping the attributes set on each parameter (its
    tensor-parallel marks): ``to_empty`` replaces meta parameters by new objects."""
    saved = {name: {a: getattr(p, a) for a in _PARAM_ATTRIBUTES if hasattr(p, a)}
             for name, p in model.named_parameters()}
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        for attr, value in saved[name].items():
            setattr(p, attr, value)


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter in ``dtype``, as Megatron's ``Float16Module`` casts a
    bfloat16 model: its norms (``torch.nn.RMSNorm``/``LayerNorm`` behind ``WrappedTorchNorm``)
    are made in float32 whatever ``params_dtype`` says. In place (``.data``), so each parameter
    keeps its object and the attributes set on it; buffers (RoPE's float32 frequencies) stay."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _mark_megatron_shards(model: torch.nn.Module) -> None:
    """Give Megatron's own layers the tensor-parallel marks they set only while initialising
    (``perform_initialization``, off here because a checkpoint always follows): without them
    Megatron's gradient norm would take a rank's shard for a copy of rank 0's."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    split = ((VocabParallelEmbedding, 0), (ColumnParallelLinear, 0), (RowParallelLinear, 1))
    for module in model.modules():
        weight = getattr(module, "weight", None)
        for cls, dim in split:
            if isinstance(module, cls) and weight is not None and not hasattr(weight, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(weight, True, dim, 1)


def build_stage(
    arch: ModelArch,
    rank_config: RankConfig,
    layout: Layout | LayoutPlan,
    groups: ParallelGroups,
    *,
    dtype: torch.dtype = torch.float32,
) -> Stage:
    """Construct this rank's empty model stage for ``layout`` (one layout, or a ``LayoutPlan``
    with one per block); a block built dense ignores its ranks in the rank config. The sizes
    must split the model (``parallel.topology.check_parallel_sizes``, checked with the job)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = as_plan(layout, arch.num_layers)
    built_ranks = layout.built_ranks(rank_config, arch)
    config = transformer_config(arch, tp=groups.tp_size, pp=groups.pp_size, dtype=dtype)
    # Per-layer dist-checkpoint keys: decomposed layers have per-layer ranks, which cannot share
    # a tensor stacked over layers (layers.sharded_state); model.sharded_state_dict() then works as is.
    config.hetereogenous_dist_checkpoint = bool(built_ranks.modules)
    spec = decomposed_block_spec(config, built_ranks, layout, pp_rank=groups.pp_rank)
    vocab = padded_vocab_size(arch.vocab_size, groups.tp_size)
    with torch.device("meta"):
        model = GPTModel(
            config,
            spec,
            vocab_size=vocab,
            max_sequence_length=arch.max_positions,
            pre_process=groups.is_first_stage,
            post_process=groups.is_last_stage,
            parallel_output=False,
            # Across pipeline stages the head keeps its own copy, loaded from the embedding.
            share_embeddings_and_output_weights=arch.tied_embeddings and groups.pp_size == 1,
            position_embedding_type="rope" if arch.rotary else "learned_absolute",
            rotary_base=arch.rope_theta if arch.rotary else 10000,
            pg_collection=groups.pg_collection,
        )
    _mark_megatron_shards(model)
    _cast_parameters(model, dtype)  # on the meta device: nothing is allocated twice
    _to_empty_keeping_attributes(model, groups.device)
    model.eval()
    model.requires_grad_(False)  # inference; training turns on what it trains (``training``)
    return Stage(
        model=model,
        arch=arch,
        layout=layout,
        rank_config=built_ranks,
        groups=groups,
        layer_offset=get_transformer_layer_offset(config, pp_rank=groups.pp_rank),
        num_local_layers=get_num_layers_to_build(config, pp_rank=groups.pp_rank),
        padded_vocab=vocab,
    )


def load_folder(path: str | Path, layout: Layout | LayoutPlan, groups: ParallelGroups, *,
                dtype: torch.dtype = torch.float32, verify: bool = True) -> Stage:
    """Open a model folder (dense or decomposed), or a Megatron checkpoint written by
    ``convert --to megatron``, and load this rank's stage.

    ``verify=False`` when the command verified the manifest already, before the ranks started;
    shapes and non-finite values are checked either way.
    """

    if is_dist_checkpoint(path):  # Megatron's dist_checkpointing reads this rank's slices only
        arch, ranks, _, _ = open_checkpoint(path, verify=verify, read=False)
        stage = build_stage(arch, ranks, layout, groups, dtype=dtype)
        load_model_state(stage, iteration_dir(path), ranks)
        return stage
    folder = open_model(path, verify=verify)
    stage = build_stage(folder.arch, folder.rank_config, layout, groups, dtype=dtype)
    load_weights(stage, folder.source, folder.rank_config)
    return stage


def load_weights(stage: Stage, source: Mapping[str, Any], source_ranks: RankConfig) -> None:
    """Fill ``stage`` from Hugging Face-named tensors decomposed as ``source_ranks`` says.

    The factors of every block built dense (all of them under the dense layout) are multiplied
    out (``W = U·V``) on the fly; the other blocks load their factors as they are.
    """
    built = dict(stage.rank_config.modules)
    dense = stage.layout.dense_modules(stage.arch)
    if built != {n: r for n, r in source_ranks.modules.items() if n not in dense}:
        raise ValueError("the checkpoint's rank config differs from the one the model was built with")
    multiplied = {n: r for n, r in source_ranks.modules.items() if n not in built}
    if multiplied:
        source = MultipliedOut(source, RankConfig.from_mapping(multiplied, stage.arch))
    load_stage(
        stage.model,
        source,
        stage.arch,
        stage.rank_config,
        layer_offset=stage.layer_offset,
        num_local_layers=stage.num_local_layers,
    )
