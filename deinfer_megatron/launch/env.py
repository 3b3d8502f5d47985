"""Who started us: torchrun, the DeepSpeed launcher, Slurm's srun — or nobody.

Every launcher describes the rank differently; ``detect()`` reads them into one ``LaunchEnv``
and ``export()`` writes the variables ``torch.distributed`` reads (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "deepspeed" | "slurm"

    def export(self) -> None:
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def _first_slurm_host(nodelist: str) -> str:
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout.split()
        return out[0] if out else "127.0.0.1"
    except (OSError, subprocess.CalledProcessError):
        return nodelist.split(",")[0]


def detect(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The launcher's view of this process, or None when no launcher started it."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "deepspeed"
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            launcher=launcher,
        )
    # Inside an srun step (not the batch script itself, which also sees SLURM_PROCID=0).
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        world = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
        job = int(env.get("SLURM_JOB_ID", "0"))
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=world,
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))),
            master_port=int(env.get("MASTER_PORT", str(15000 + job % 10000))),
            launcher="slurm",
        )
    return None
