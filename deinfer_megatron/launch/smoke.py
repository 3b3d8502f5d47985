"""A cluster check before a real job: do the launcher's tasks form a working process group?

``python -m deinfer_megatron.launch.smoke`` runs in every task of an srun step
(scripts/slurm/smoke.sbatch; torchrun works too). Each task maps its launcher's variables with
``env.detect()`` — the mapping every job of the project uses, so a pass here means ``generate``
finds its ranks the same way — joins a gloo group through torch's ``env://``, all-reduces the
rank numbers and prints ``rank=R world=W sum=S`` on stdout (where it ran, on stderr). The exit
status is 1 when the sum is not 0 + 1 + … + (W − 1), 2 when no launcher started the process.

It calls ``torch.distributed`` itself rather than ``parallel.comm``: what it checks is the
launch mapping and the network below the project's collectives, and ``launch`` sits below
``parallel`` in the package order.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

from deinfer_megatron.launch.env import detect
from deinfer_megatron.launch.lifetime import die_with_parent

TIMEOUT = datetime.timedelta(seconds=60)


def main() -> int:
    """Run the check as this task's rank; the process's exit status."""
    try:
        env = detect()
        if env is None:
            raise RuntimeError("no launcher started this process; run it in every task of an srun step "
                               "(scripts/slurm/smoke.sbatch) or under torchrun")
    except RuntimeError as err:
        print(f"deinfer_megatron.launch.smoke: error: {err}", file=sys.stderr)
        return 2
    die_with_parent()  # the launcher's death ends this rank too
    env.export()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    print(f"[{socket.gethostname()}] {env.launcher} rank={env.rank} world={env.world_size} "
          f"local_rank={env.local_rank} master={env.master_addr}:{env.master_port} python={sys.executable}",
          file=sys.stderr, flush=True)
    dist.init_process_group(backend="gloo", init_method="env://", rank=env.rank,
                            world_size=env.world_size, timeout=TIMEOUT)
    try:
        total = torch.tensor([env.rank], dtype=torch.int64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        print(f"rank={env.rank} world={dist.get_world_size()} sum={int(total)}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    expected = env.world_size * (env.world_size - 1) // 2
    if int(total) != expected:
        print(f"rank={env.rank}: all_reduce sum {int(total)} != expected {expected}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
