"""Read tensors of a PyTorch Distributed Checkpoint (DCP) folder in one process, safely.

Megatron-Core's ``torch_dist`` checkpoints are DCP folders underneath: a pickled ``.metadata``
index (every tensor's global shape, dtype and where its chunks lie in the ``*.distcp`` files)
and the chunks themselves, saved by ``torch.save``. Reading a file needs no process group:
each requested tensor is allocated at its saved global shape and ``torch.distributed.checkpoint``
fills it with ``no_dist=True`` — it stitches together the chunks that every saving rank wrote.

torch unpickles ``.metadata`` with plain ``pickle``, which runs whatever code the file names.
Here it is unpickled with an allowlist — DCP's own metadata dataclasses and enums,
``torch.Size``, dtypes and paths — while torch reads the chunks with ``weights_only=True``, so
reading a checkpoint never runs code from it (``megatron_args.load_pickle`` keeps the same
promise for ``common.pt``).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

# Modules whose dataclasses and enums (no other classes, no functions) may appear in DCP metadata.
_METADATA_MODULES = frozenset({
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
})
# Harmless callables DCP metadata is pickled with (torch's own writer stores the folder as a path).
_ALLOWED_FUNCTIONS = {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                      ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global is refused instead of imported."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _ALLOWED_FUNCTIONS:
                return getattr(importlib.import_module(module), name)
            if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
                return getattr(torch, name)
            if module in _METADATA_MODULES:
                found = getattr(importlib.import_module(module), name, None)
                if (isinstance(found, type) and found.__module__ == module
                        and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))):
                    return found
        raise pickle.UnpicklingError(f"'{module}.{name}' is not part of checkpoint metadata")


def _reader(folder: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """``FileSystemReader`` whose metadata is unpickled with the allowlist (once)."""

        metadata: Any = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self.metadata is not None:
                return self.metadata
            path = Path(self.path) / ".metadata"
            try:
                with open(path, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, OSError, AttributeError, ImportError) as err:
                raise ValueError(f"cannot read {path} as distributed-checkpoint metadata ({err}); "
                                 "is the checkpoint complete?") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self.metadata = metadata
            return metadata

    return SafeReader(str(folder))


def read_dcp_tensors(folder: Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every tensor of the DCP checkpoint ``folder`` whose key starts with one of ``prefixes``,
    at its saved global shape and dtype (on the CPU). Non-tensor entries (bytes) are skipped.

    Raises:
        ValueError: the metadata cannot be read, or names something other than DCP metadata.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _reader(Path(folder))
    metadata = reader.read_metadata()
    tensors = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata) and key.startswith(prefixes)
    }
    with warnings.catch_warnings():  # one process reading on purpose, not a forgotten init
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors
