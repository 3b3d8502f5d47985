"""The engine that drives a loaded stage: Megatron-Core's own forward, or DeepSpeed-Inference
around the already tensor-parallel stage (no re-sharding).

``deepspeed.init_inference`` is given the Megatron TP group through an ``mpu`` adapter, so its
engine knows the model is tensor-parallel, and an injection policy naming a class that never
occurs in the model, so AutoTP (which would try to re-shard the layers) has nothing to replace.
Communication stays on the gloo group the ranks already share; on CPU DeepSpeed's shared-memory
all-reduce is switched off first (``patches.deepspeed_cpu``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deinfer_megatron import patches
from deinfer_megatron.models.build import Stage
from deinfer_megatron.parallel.runtime import ParallelGroups
from deinfer_megatron.runtime.options import Engine


class _NoSuchModule(nn.Module):
    """An injection-policy key that matches nothing: it keeps AutoTP from re-sharding."""


class TensorParallelMPU:
    """What DeepSpeed-Inference asks of ``mpu``: "model parallel" means tensor parallel here
    (Megatron's own model-parallel group is TP×PP)."""

    def __init__(self, groups: ParallelGroups) -> None:
        self._groups = groups

    def get_model_parallel_group(self) -> Any:
        return self._groups.pg_collection.tp

    def get_model_parallel_rank(self) -> int:
        return self._groups.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self._groups.tp_size

    def get_data_parallel_group(self) -> Any:
        return self._groups.pg_collection.dp

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size


def wrap_with_deepspeed(model: nn.Module, groups: ParallelGroups, dtype: torch.dtype) -> nn.Module:
    """Return ``deepspeed.init_inference(model)`` on the existing process groups."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("DeepSpeed-Inference on this project runs in float32 or bfloat16")
    patches.deepspeed_cpu.apply()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    engine = deepspeed.init_inference(
        model,
        dtype=dtype,
        replace_with_kernel_inject=False,
        tensor_parallel={"tp_size": groups.tp_size, "mpu": TensorParallelMPU(groups)},
        injection_policy={_NoSuchModule: ()},
    )
    if engine.module is not model:
        raise AssertionError("DeepSpeed replaced the model instead of wrapping it")
    return engine


def driven_by(engine: Engine, stage: Stage, dtype: torch.dtype) -> Stage:
    """``stage`` as ``engine`` drives it: itself under Megatron, wrapped in DeepSpeed-Inference
    otherwise (its forward calls then go through the engine: ``Stage.runner``)."""
    if engine is Engine.MEGATRON:
        return stage
    return stage.with_runner(wrap_with_deepspeed(stage.model, stage.groups, dtype))
