"""Run a function on N real gloo ranks (one spawned process each) and collect the results.

One launch per world size runs many checks, because starting ranks costs seconds. A failure on
any rank fails the caller with that rank's traceback; a hung rank fails it after ``timeout``.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        result = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        result = ("error", traceback.format_exc())
    path.write_bytes(pickle.dumps(result))
    if result[0] == "error":
        os._exit(1)  # do not wait for peers blocked in a collective


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 600) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` ranks; return each rank's return value, by rank."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_entry, args=(r, world, port, out_dir, fn, args), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(1.0)  # let the failing rank's peers write what they have
                break
            time.sleep(0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results = []
        for rank in range(world):
            path = Path(out_dir) / f"rank{rank}.pkl"
            if path.exists():
                results.append(pickle.loads(path.read_bytes()))
            else:
                results.append(("error", f"rank {rank} gave no result (exit code {procs[rank].exitcode}; "
                                         f"killed after {timeout} s or by a failing peer)"))
        errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in enumerate(results) if s == "error"]
        if errors:
            raise AssertionError("\n".join(errors))
        return [v for _, v in results]
