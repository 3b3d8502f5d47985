"""What every factor module shares: a TP view, a name for errors, loaders looked up by name,
and initialisation through those loaders.

Kept apart from ``factors.py`` (the six ways of sharding a factor) so that each file reads in
one sitting; ``factors`` re-exports ``read_block``, which the checkpoint loaders use too.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from deinfer_megatron.layers.sharded_state import factor_sharded_state_dict
from deinfer_megatron.parallel.topology import TPView

InitMethod = Callable[[torch.Tensor], Any]


def read_block(source: Any, rows: slice, cols: slice | None = None) -> torch.Tensor:
    """Read ``source[rows, cols]`` from a tensor or a lazy safetensors slice."""
    block = source[rows] if cols is None else source[rows, cols]
    return block if isinstance(block, torch.Tensor) else torch.as_tensor(block)


def check_shape(source: Any, expected: tuple[int, ...], prefix: str, what: str) -> None:
    """Refuse a checkpoint tensor whose shape differs from what the configs imply."""
    got = tuple(source.shape if isinstance(source, torch.Tensor) else source.get_shape())
    if got != expected:
        raise ValueError(
            f"{prefix}: {what} has shape {list(got)} but the model config and rank config "
            f"expect {list(expected)}; check that the checkpoint matches its rank_config.json"
        )


def local_param(shape: tuple[int, ...], dtype: torch.dtype, *, partition_dim: int | None,
                stride: int = 1, duplicate: bool = False) -> nn.Parameter:
    """An uninitialised, trainable parameter of this rank's shard, carrying Megatron's
    tensor-parallel attributes so that Megatron's grad-norm, clipping, DDP and optimizer count
    it once.

    Args:
        partition_dim: the dimension split over the TP ranks; None for a parameter every rank
            holds whole (replicated: Megatron counts it on TP rank 0 only).
        stride: Megatron's ``partition_stride`` (sections interleaved in the split dimension).
        duplicate: this rank's slice is also held by a lower rank (KV heads replicated over
            ranks): marked not tensor-parallel, so only the first holder is counted.

    Inference builds turn gradients off for the whole model (``models.build``).
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    param = nn.Parameter(torch.empty(shape, dtype=dtype))
    parallel = partition_dim is not None and not duplicate
    set_tensor_model_parallel_attributes(param, parallel, partition_dim if parallel else -1, stride)
    return param


def section_ranks_of(section_ranks: Sequence[int]) -> tuple[int, ...]:
    """Section ranks as a tuple of ints (they arrive as lists from JSON or tuples from specs)."""
    return tuple(int(r) for r in section_ranks)


class Factor(nn.Module):
    """Shared bookkeeping: the TP view, the Megatron layer number, a name for errors, and
    initialisation through the loaders.

    Subclasses give ``_source_shape(shard_id)``: the full (checkpoint-orientation) shape of
    section ``shard_id``'s factor, which the loader expects and the initialisation draws.
    """

    def __init__(self, tp_group: Any, layer_number: int, prefix: str) -> None:
        super().__init__()
        self.tp = TPView.of(tp_group)
        self.layer_number = layer_number
        self.prefix = prefix

    def extra_repr(self) -> str:
        return f"tp={self.tp.rank}/{self.tp.size}"

    def loader_for(self, name: str) -> tuple[Any, int]:
        """``(weight_loader, number of shard ids)`` for parameter ``name`` of this module.

        Looked up when loading (not stored on the parameter), so it survives ``to_empty``.
        """
        return getattr(self, f"_load_{name}"), len(self.section_ranks)

    def _source_shape(self, shard_id: int) -> tuple[int, int]:
        raise NotImplementedError

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """Megatron dist-checkpointing: one global tensor per section, in checkpoint
        orientation, whatever the layout and TP size (``layers.sharded_state``)."""
        return factor_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def _initialise(self, config: Any, init_method: InitMethod | None) -> None:
        """Fill the local shard from full factors drawn with ``init_method`` (TP-invariant).

        Like Megatron's ``_initialize_affine_weight_cpu``: a float32 master of the full
        (unsharded) factor, section by section, from the default generator — so the draws, and
        hence the full factors, are the same at every TP size — then this rank's slice of it,
        taken by the parameter's own loader (which also zeroes any padding). Nothing happens
        unless ``config.perform_initialization`` (the project builds for loading with it off),
        nor on the meta device, where there is no storage to fill. Biases start at zero, as
        Megatron's do. ``init_method`` None means ``config.init_method``.
        """
        if not config.perform_initialization or self.weight.device.type == "meta":
            return
        init = init_method if init_method is not None else config.init_method
        loader, sections = self.loader_for("weight")
        with torch.no_grad():
            for shard_id in range(sections):
                master = torch.empty(self._source_shape(shard_id), dtype=torch.float32)
                init(master)
                loader(self.weight, master, shard_id)
            bias = getattr(self, "bias", None)
            if bias is not None:
                bias.zero_()
