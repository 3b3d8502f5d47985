"""Joining the ranks: torch.distributed (NCCL on GPUs, gloo on CPU) plus Megatron's TP/PP groups.

The groups are created once by ``megatron.core.parallel_state`` and then handed around as an
explicit ``ParallelGroups`` value — layers never read Megatron's globals themselves. The value
also says where this rank's tensors live (``device``): its own GPU under NCCL (one per local
rank, ``LOCAL_RANK``), else the CPU — models are built there and pipeline buffers allocated there.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from deinfer_megatron import patches
from deinfer_megatron.launch import allocator
from deinfer_megatron.parallel import collectives as transports
from deinfer_megatron.parallel.collectives import Collectives
from deinfer_megatron.parallel.rendezvous import local_store


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the TP × PP grid and the process groups Megatron modules take."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    pg_collection: Any  # megatron.core.process_groups_config.ProcessGroupCollection
    device: torch.device = torch.device("cpu")  # where this rank's model and buffers live
    transport: transports.Installed = field(default_factory=transports.Installed)  # what carries TP collectives

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> int:
        return dist.get_global_rank(self.pg_collection.pp, self.pp_rank + 1)

    @property
    def prev_rank(self) -> int:
        return dist.get_global_rank(self.pg_collection.pp, self.pp_rank - 1)

    @property
    def last_stage_rank(self) -> int:
        return dist.get_global_rank(self.pg_collection.pp, self.pp_size - 1)


def default_backend() -> str:
    """NCCL where CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def job_device() -> torch.device:
    """Where this rank computes: CUDA's current device when CUDA is available and the job's
    backend is NCCL, else the CPU (a gloo job stays on the CPU even on a GPU machine)."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _select_gpu(rank: int) -> None:
    """One GPU per local rank (``LOCAL_RANK``, set by every launcher; else rank modulo the
    GPUs of this machine), chosen before NCCL's communicators bind to a device."""
    local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    if local >= torch.cuda.device_count():
        raise RuntimeError(f"local rank {local} has no GPU of its own ({torch.cuda.device_count()} visible); "
                           "start at most one rank per GPU on each node")
    torch.cuda.set_device(local)


def init_parallel(tp: int, pp: int, *, timeout_s: float = 300.0,
                  collectives: Collectives | str = Collectives.AUTO) -> ParallelGroups:
    """Initialise torch.distributed from the launcher's environment and build the TP/PP groups.

    Reads ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (set by torchrun, the DeepSpeed
    launcher, or mapped from Slurm by ``deinfer_megatron.launch``). ``timeout_s`` bounds every
    collective so that a dead peer ends the job instead of hanging it. ``collectives`` chooses
    what carries the TP group's collectives (``parallel.collectives``: shared memory between the
    CPU ranks of a node by default, or the process group throughout).
    """
    collectives = Collectives.parse(collectives)
    allocator.configure()  # ranks started through the Python API, not the command
    patches.apply_all()
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not dist.is_initialized():
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = default_backend()
        if backend == "nccl":
            _select_gpu(rank)
        dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                timeout=timeout, store=local_store(rank, world, timeout))
    elif dist.get_backend() == "nccl" and "LOCAL_RANK" in os.environ:
        _select_gpu(dist.get_rank())  # a launcher (DeepSpeed, torchrun) joined the ranks already
    world = dist.get_world_size()
    if tp * pp != world:
        raise RuntimeError(
            f"TP×PP = {tp}×{pp} = {tp * pp} but the launcher started {world} ranks; "
            f"start {tp * pp} ranks or change --tp/--pp"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
    )
    device = job_device()
    if device.type == "cuda":
        # Megatron's attention forks its CUDA RNG tracker (for dropout), which needs its states;
        # the inference tracker of Megatron's own, as on CPU (patches.megatron_cpu).
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    transports.uninstall_all()  # a second init in one process replaces the first's groups
    installed = transports.install(parallel_state.get_tensor_model_parallel_group(), collectives,
                                   timeout_s=timeout_s)
    return ParallelGroups(
        transport=installed,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=tp,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=pp,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        device=device,
    )


def shutdown() -> None:
    """Tear down Megatron's groups and the default process group."""
    from megatron.core import parallel_state

    transports.uninstall_all()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
