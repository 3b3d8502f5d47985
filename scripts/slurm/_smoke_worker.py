"""One rank of scripts/slurm/smoke.sbatch.

Launched once per Slurm task by ``srun``. Maps the Slurm task environment to
the variables ``torch.distributed``'s ``env://`` init method reads, joins a
gloo (CPU) process group, all-reduces the rank numbers and prints

    rank=R world=W sum=S

Exit status is non-zero if the sum is not 0 + 1 + ... + (W - 1).

The mapping (``slurm_to_torch_env``) is what a real multi-rank job script
should do too:

    SLURM_PROCID       -> RANK
    SLURM_NTASKS       -> WORLD_SIZE
    SLURM_LOCALID      -> LOCAL_RANK
    SLURM_JOB_NODELIST -> MASTER_ADDR  (first host of `scontrol show hostnames`)
    SLURM_JOB_ID       -> MASTER_PORT  (15000 + job_id % 10000, so concurrent
                                        jobs on one node do not collide)

MASTER_ADDR / MASTER_PORT already present in the environment (the batch
script exports them) take precedence.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys


def master_port_for_job(job_id: str | int) -> int:
    """Port derived from the job id; keep in sync with smoke.sbatch."""
    return 15000 + int(job_id) % 10000


def first_host(nodelist: str) -> str:
    """First hostname of a Slurm nodelist expression such as ``node[01-04]``."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    if not out:
        raise RuntimeError(f"scontrol show hostnames {nodelist!r} returned nothing")
    return out[0]


def slurm_to_torch_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Return RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT for this task."""
    env = os.environ if environ is None else environ
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID")
               if k not in env]
    if missing:
        raise RuntimeError(f"not inside a Slurm step (missing {', '.join(missing)}); launch with srun")
    master_addr = env.get("MASTER_ADDR") or first_host(env["SLURM_JOB_NODELIST"])
    master_port = env.get("MASTER_PORT") or str(master_port_for_job(env["SLURM_JOB_ID"]))
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env["SLURM_LOCALID"],
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
    }


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mapped = slurm_to_torch_env()
    os.environ.update(mapped)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(mapped["RANK"]), int(mapped["WORLD_SIZE"])
    print(
        f"[{socket.gethostname()}] init rank={rank} world={world} local_rank={mapped['LOCAL_RANK']} "
        f"master={mapped['MASTER_ADDR']}:{mapped['MASTER_PORT']}",
        file=sys.stderr, flush=True,
    )
    dist.init_process_group(
        backend="gloo", init_method="env://", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        t = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        total = int(t.item())
        print(f"rank={rank} world={dist.get_world_size()} sum={total}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    expected = world * (world - 1) // 2
    if total != expected:
        print(f"rank={rank}: all_reduce sum {total} != expected {expected}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
