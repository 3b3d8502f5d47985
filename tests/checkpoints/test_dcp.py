"""Reading PyTorch Distributed Checkpoint folders in one process, with metadata unpickled safely.

The checkpoint is written by torch's own ``dcp.save`` (the format under Megatron's
``torch_dist``); the Megatron folders themselves are read in ``test_megatron_ckpt.py``.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from deinfer_megatron.checkpoints.dcp import read_dcp_tensors


def _save(folder: Path, tensors: dict) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


def test_reads_the_tensors_under_the_prefixes(tmp_path) -> None:
    saved = {"decoder.a": torch.randn(3, 4), "decoder.b": torch.arange(6, dtype=torch.int32),
             "optimizer.state": torch.ones(2), "embedding.w": torch.randn(5).bfloat16()}
    _save(tmp_path, saved)
    got = read_dcp_tensors(tmp_path, ("decoder.", "embedding."))
    assert sorted(got) == ["decoder.a", "decoder.b", "embedding.w"]
    for key, tensor in got.items():
        assert tensor.dtype == saved[key].dtype and torch.equal(tensor, saved[key]), key
    assert not torch.distributed.is_initialized()


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {_Exploit.marker}",))


def test_metadata_naming_other_code_is_refused_not_run(tmp_path) -> None:
    _save(tmp_path, {"decoder.a": torch.zeros(2)})
    _Exploit.marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(ValueError, match=r"\.metadata as distributed-checkpoint metadata .*is not part of checkpoint"):
        read_dcp_tensors(tmp_path, ("decoder.",))
    assert not _Exploit.marker.exists()
