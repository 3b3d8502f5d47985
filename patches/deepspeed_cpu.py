"""DeepSpeed 0.19.8 on CPU: keep it on plain torch.distributed (gloo).

On a CPU-only machine DeepSpeed's CPU accelerator tries to build its shared-memory all-reduce
extension (``deepspeed/ops/op_builder/cpu/comm.py``, ``ShareMemCommBuilder``) when
``deepspeed.comm`` initialises: that compiles for minutes and segfaults under torchrun and
multi-node launches. The switch must be set before ``deepspeed.init_distributed``.
"""

from __future__ import annotations

import os

import torch


def apply() -> bool:
    """Select DeepSpeed's CPU accelerator and disable its shm all-reduce when CUDA is absent."""
    if torch.cuda.is_available():
        return False
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return True
