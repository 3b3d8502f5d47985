"""Runtime shims that let Megatron-Core 0.16.1 and DeepSpeed 0.19.8 run on a CPU-only machine.

``apply_all()`` is called once by the project before a model is built or a process group is
initialised. Every shim checks for CUDA itself, so on a GPU machine nothing is patched.
"""

from __future__ import annotations

from . import deepspeed_cpu, megatron_cpu


def apply_all() -> None:
    """Install every CPU shim (a no-op where CUDA is available, and when called twice)."""
    megatron_cpu.apply()
    deepspeed_cpu.apply()
