"""Start N local ranks ourselves when no launcher did, and watch them.

Each rank runs ``fn(*args)`` in a fresh (spawned) process with ``torch.distributed``'s
variables set. The parent waits for all of them; when one fails or dies, the others are killed
at once and the caller gets that rank's error — a job never hangs on a dead peer. A user error
raised in a rank (``ValueError``/``RuntimeError``/``FileNotFoundError``) is raised again in the
parent with the same type and message, so the CLI prints one clean line.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

_USER_ERRORS = (ValueError, RuntimeError, FileNotFoundError, TimeoutError)


class RankFailed(RuntimeError):
    """A rank raised an unexpected exception or died; carries its traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if world <= len(cpus):  # one core per rank: steadier timings, no two ranks on one core
        os.sched_setaffinity(0, {cpus[rank]})
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        result: tuple = ("ok", fn(*args))
    except BaseException as err:  # noqa: BLE001 - everything is reported to the parent
        result = ("error", type(err).__name__, str(err), traceback.format_exc())
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(result))
    tmp.rename(path)
    if result[0] == "error":
        os._exit(1)  # never wait for peers blocked in a collective


def spawn_local(world: int, fn: Callable, *args: Any, timeout: float | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` local ranks and return every rank's result, by rank.

    Raises the failing rank's user error (same type and message), ``RankFailed`` for anything
    else, and ``TimeoutError`` past ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="deinfer-ranks-") as out_dir:
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, port, out_dir, fn, args), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        timed_out = False
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.5)  # let a failing rank's peers report too, then stop them
                break
            if deadline is not None and time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        stopped = set()  # ranks this launcher killed itself (after a peer failed, or on timeout)
        for rank, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                stopped.add(rank)
            p.join()
        results = []
        for rank, p in enumerate(procs):
            path = Path(out_dir) / f"rank{rank}.pkl"
            results.append(pickle.loads(path.read_bytes()) if path.exists() else None)
    if timed_out:
        raise TimeoutError(f"the {world} ranks did not finish within {timeout:.0f} s")
    # A rank that vanished (killed, crashed) is the cause; its peers' errors are echoes of it.
    died = [r for r, res in enumerate(results) if res is None and r not in stopped]
    if died:
        codes = ", ".join(f"rank {r} (exit code {procs[r].exitcode})" for r in died)
        raise RankFailed(f"{codes} died; the other ranks were stopped")
    user = {cls.__name__: cls for cls in _USER_ERRORS}
    errors = [(r, res) for r, res in enumerate(results) if res is not None and res[0] == "error"]
    errors.sort(key=lambda e: e[1][1] not in user)  # a user error is the cause, not its echoes
    if errors:
        rank, (_, kind, message, tb) = errors[0]
        if kind in user:
            err = user[kind](message)
            err.add_note(f"raised on rank {rank}:\n{tb}")
            raise err
        raise RankFailed(f"rank {rank} failed with {kind}: {message}\n{tb}")
    if any(res is None for res in results):
        raise RankFailed("ranks were stopped without a result or an error")  # not expected
    return [res[1] for res in results]
