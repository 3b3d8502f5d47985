"""Runtime shims that let Megatron-Core 0.16.1 and DeepSpeed 0.19.8 run on a CPU-only machine.

``apply_all()`` is called by the project before a model is built or a process group is
initialised; ``deepspeed_cpu.apply()`` is called before DeepSpeed initialises (it imports
DeepSpeed, so it is not paid for when DeepSpeed is not used). Every shim checks for CUDA
itself: on a GPU machine nothing is patched. Where it does patch, it first checks the installed
version (``versions.require_version``: a one-line ``RuntimeError`` naming the fix), and it acts
only inside the upstream functions it covers — ``torch.cuda`` stays torch's own elsewhere.

``megatron_import.install()`` runs earlier, when the ``deinfer_megatron`` package is imported:
without CUDA, Megatron-Core's fusion decorators become its own no-op (import time, not values).
"""

from __future__ import annotations

import sys

from . import deepspeed_cpu, megatron_cpu


def apply_all() -> None:
    """Install the CPU shims (no-op where CUDA is available, and when called twice)."""
    megatron_cpu.apply()
    if "deepspeed" in sys.modules:
        deepspeed_cpu.apply()
