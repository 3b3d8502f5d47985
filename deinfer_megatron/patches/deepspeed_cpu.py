"""DeepSpeed 0.19.8 on CPU: keep its communication on plain torch.distributed (gloo).

On a CPU-only machine ``deepspeed.comm``'s ``TorchBackend.__init__`` calls ``build_shm_op()``
(``deepspeed/comm/torch.py``), which JIT-compiles the shared-memory all-reduce extension
``deepspeed_shm_comm``: that takes minutes and segfaults under torchrun and multi-node
launches. There is no run-time switch (``DS_BUILD_SHM_COMM`` only acts at install time), so
the op is marked incompatible in ``deepspeed.ops.__compatible_ops__``, which ``build_shm_op``
checks first. This must happen before ``deepspeed.init_distributed``/``init_inference``.
Both changes are as narrow as the upstream code they cover: one entry of DeepSpeed's op table
and the module-level ``build_shm_op`` name that ``TorchBackend.__init__`` calls.
"""

from __future__ import annotations

import importlib
import os

import torch

from deinfer_megatron.patches.versions import require_version

PINNED = "0.19.8"
_APPLIED = False


def apply() -> bool:
    """Select DeepSpeed's CPU accelerator and disable its shm all-reduce when CUDA is absent.

    Raises:
        RuntimeError: the installed DeepSpeed is not the version this shim was read from.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False
    require_version("deepspeed", PINNED)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # importlib, not `import deepspeed.comm.torch as m`: that name resolves to the torch package.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    _APPLIED = True
    return True
