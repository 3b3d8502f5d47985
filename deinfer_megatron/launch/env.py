"""Who started us: torchrun, the DeepSpeed launcher, Slurm's srun — or nobody.

Every launcher describes the rank differently; ``detect()`` reads them into one ``LaunchEnv``
and ``export()`` writes the variables ``torch.distributed`` reads (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, and ``LOCAL_WORLD_SIZE`` where known).

This is the one place that maps Slurm's variables to torch.distributed's: the sbatch scripts
just call ``srun`` and every task maps its own. Inside an srun step (the batch script itself is
not one) task ``SLURM_PROCID`` of ``SLURM_STEP_NUM_TASKS`` is the rank, ``SLURM_LOCALID`` the
local rank, ``SLURM_STEP_TASKS_PER_NODE`` the node's ranks (``LOCAL_WORLD_SIZE``, as torchrun
sets it: the memory check counts the ranks sharing a machine by it), the first node of
``SLURM_STEP_NODELIST`` the master — Slurm's block and cyclic distributions put task 0 there —
and ``slurm_port(SLURM_JOB_ID)`` its port, so that two jobs sharing a node do not collide.
``MASTER_ADDR`` / ``MASTER_PORT`` in the task's environment (sbatch passes the submitter's on)
take precedence: for nodes whose names do not resolve, or a port of one's own.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

# Below Linux's ephemeral range (32768-60999), so a job's port is never a client socket's.
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 10000


@dataclass(frozen=True)
class LaunchEnv:
    """One rank as its launcher started it: where it sits in the job and how to find rank 0."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "deepspeed" | "slurm"
    local_world_size: int | None = None  # ranks on this node, where the launcher says

    def export(self) -> None:
        """Write torch.distributed's variables into this process's environment."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )
        if self.local_world_size is not None:
            os.environ["LOCAL_WORLD_SIZE"] = str(self.local_world_size)


def slurm_port(job_id: int) -> int:
    """The rendezvous port of Slurm job ``job_id``: jobs whose ids differ by less than
    ``SLURM_PORT_SPAN`` never share one, whichever nodes they land on."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list, the one ``scontrol show hostnames`` prints first:
    ``node[07-09,12],gpu1`` → ``node07``, ``rack[1-2]-n[3-4]`` → ``rack1-n3``.

    Parsed here rather than by running scontrol in every task: only the first item's first
    range matters, and its zero padding is kept as written.
    """
    item, depth = nodelist, 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            item = nodelist[:i]
            break
    host = _BRACKETS.sub(lambda m: re.split(r"[,-]", m.group(1))[0], item.strip())
    if not host or re.search(r"[\[\],\s]", host):
        raise RuntimeError(f"cannot read the first node of the Slurm node list {nodelist!r}; "
                           "set MASTER_ADDR to the first node's address")
    return host


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """The count for node ``node_id`` in Slurm's per-node task counts, ``2(x3),1`` being
    2, 2, 2, 1 (``SLURM_STEP_TASKS_PER_NODE``)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise RuntimeError(f"cannot read Slurm's tasks per node {tasks_per_node!r}; "
                               "set LOCAL_WORLD_SIZE to the ranks on this node")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise RuntimeError(f"node {node_id} is not among Slurm's tasks per node {tasks_per_node!r}; "
                           "set LOCAL_WORLD_SIZE to the ranks on this node")
    return counts[node_id]


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of an srun step. The batch script sees ``SLURM_PROCID=0``
    too but has no step id, so a command run there directly starts its own ranks."""
    return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


def _slurm_env(env: Mapping[str, str]) -> LaunchEnv:
    def need(*names: str) -> str:
        for name in names:
            if env.get(name):
                return env[name]
        raise RuntimeError(f"this srun step has no {names[0]}; start the ranks with srun from a Slurm "
                           "job (scripts/slurm/generate.sbatch)")

    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    else:
        addr = first_host(need("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else slurm_port(int(need("SLURM_JOB_ID")))
    local_world = None
    if env.get("SLURM_STEP_TASKS_PER_NODE") and env.get("SLURM_NODEID"):
        local_world = tasks_on_node(env["SLURM_STEP_TASKS_PER_NODE"], int(env["SLURM_NODEID"]))
    return LaunchEnv(
        rank=int(env["SLURM_PROCID"]),
        world_size=int(need("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")),
        local_rank=int(need("SLURM_LOCALID")),
        master_addr=addr,
        master_port=port,
        launcher="slurm",
        local_world_size=local_world,
    )


def detect(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The launcher's view of this process, or None when no launcher started it."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            launcher="torchrun" if "TORCHELASTIC_RUN_ID" in env else "deepspeed",
            local_world_size=int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE") else None,
        )
    if in_slurm_step(env):
        return _slurm_env(env)
    return None
