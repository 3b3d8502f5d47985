"""Run a job on TP×PP ranks: join the launcher that started us, or start the ranks ourselves.

Inside torchrun, the DeepSpeed launcher or an srun step this process *is* one rank: the
launcher's variables are mapped to torch.distributed's and the job runs here. Outside any
launcher the ranks are spawned locally (``spawn_local``) and watched; a single rank runs in
this process. Either way the caller
gets global rank 0's result on the process that should report it, and None elsewhere.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

from deinfer_megatron.launch.env import detect
from deinfer_megatron.launch.lifetime import PARENT_PID_ENV, SCRATCH_ENV, die_with_parent, watch_process
from deinfer_megatron.launch.local import free_port, local_rank_env, spawn_local


@contextlib.contextmanager
def _single_rank_env() -> Iterator[None]:
    """torch.distributed's variables for a one-rank group, restored afterwards (so that later
    calls in this process do not mistake themselves for a launched rank)."""
    env = local_rank_env(0, 1, free_port())
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_on_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any | None:
    """Run ``fn(*args)`` on ``world`` ranks; return global rank 0's result where it reports."""
    env = detect()
    if env is not None:
        if env.world_size != world:
            raise RuntimeError(
                f"TP×PP = {world} but the {env.launcher} launcher started {env.world_size} ranks; "
                f"start {world} ranks or change --tp/--pp"
            )
        if os.environ.get(PARENT_PID_ENV, "").isdigit():
            # Started by `--launcher`: the command behind the launcher is watched (it outlives
            # the launcher), and the rank clears the job's scratch folder if that command was
            # killed. A parent-death signal would kill the rank before it could.
            watch_process(int(os.environ[PARENT_PID_ENV]), os.environ.get(SCRATCH_ENV))
        else:
            die_with_parent()  # the launcher's death ends this rank too
        env.export()
        result = fn(*args)
        return result if env.rank == 0 else None
    if world == 1:  # one rank needs no second process
        with _single_rank_env():
            return fn(*args)
    return spawn_local(world, fn, *args, timeout=timeout)[0]


def global_rank() -> int:
    """This process's global rank, inside the function ``run_on_ranks`` runs and before
    torch.distributed exists: every way a rank starts (a launcher, ``spawn_local``, the single
    rank in this process) has set ``RANK`` by then."""
    return int(os.environ["RANK"])
