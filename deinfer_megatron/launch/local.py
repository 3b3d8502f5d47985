"""Start N local ranks ourselves when no launcher did, and watch them.

Each rank runs ``fn(*args)`` in a fresh (spawned) process with ``torch.distributed``'s
variables set, and sends its result back through a pipe — nothing is written to disk. The
parent waits for all of them; when one fails or dies, the others are killed at once and the
caller gets that rank's error — a job never hangs on a dead peer. A user error raised in a rank
(``ValueError``/``RuntimeError``/``FileNotFoundError``) is raised again in the parent with the
same type and message, so the CLI prints one clean line.

Lifetime: ranks die with the parent (``lifetime.die_with_parent``), even under ``kill -9``;
they ignore Ctrl-C, which the parent handles by stopping them all. Exposure: the ranks talk
over loopback only (the rendezvous store and gloo's sockets bind 127.0.0.1).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import time
import traceback
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch.multiprocessing as mp

from deinfer_megatron.launch.lifetime import die_with_parent

_USER_ERRORS = (ValueError, RuntimeError, FileNotFoundError, TimeoutError)
LOOPBACK = "127.0.0.1"


class RankFailed(RuntimeError):
    """A rank raised an unexpected exception or died; carries its traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def local_rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """torch.distributed's variables for rank ``rank`` of a job on this machine only."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo"}  # gloo's pair sockets on loopback, not the host's address


def _rank_main(rank: int, world: int, port: int, parent: int, conn: Connection, warning_filters: list,
               work: bytes) -> None:
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    warnings.filters[:] = warning_filters  # a rank warns about what its command warns about
    # ``fn`` and its arguments arrive pickled and are loaded only now: loading them imports
    # their modules (Megatron among them), whose import-time warnings the filters must see.
    fn, args = pickle.loads(work)
    os.environ.update(local_rank_env(rank, world, port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if world <= len(cpus):  # one core per rank: steadier timings, no two ranks on one core
        os.sched_setaffinity(0, {cpus[rank]})
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        result: tuple = ("ok", fn(*args))
    except BaseException as err:  # noqa: BLE001 - everything is reported to the parent
        result = ("error", type(err).__name__, str(err), traceback.format_exc())
    # Plain pickle, sent as bytes: the connection's own pickler would pass tensors as shared
    # memory handles, which the parent could no longer open once this process has exited.
    try:
        payload = pickle.dumps(result)
    except Exception as err:  # noqa: BLE001 - a result that cannot be pickled
        result = ("error", type(err).__name__, f"could not send the result: {err}", traceback.format_exc())
        payload = pickle.dumps(result)
    conn.send_bytes(payload)
    conn.close()
    if result[0] == "error":
        os._exit(1)  # never wait for peers blocked in a collective


def _stop(procs: list[Any]) -> set[int]:
    """Kill the ranks still running; return which ones had to be killed."""
    stopped = set()
    for rank, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            stopped.add(rank)
    for p in procs:
        p.join()
    return stopped


def _collect(procs: list[Any], conns: list[Connection], deadline: float | None) -> tuple[list, bool]:
    """Every rank's result (None for a rank that sent none) and whether time ran out.

    Stops waiting half a second after the first failure, so that a failing rank's peers can
    report too but no rank is waited on while it hangs on its dead peer.
    """
    results: list[Any] = [None] * len(procs)
    pending = dict(enumerate(conns))
    failed_at = None
    while pending or any(p.is_alive() for p in procs):
        for conn in wait(list(pending.values()) + [p.sentinel for p in procs if p.is_alive()], timeout=0.05):
            rank = next((r for r, c in pending.items() if c is conn), None)
            if rank is None:
                continue  # a process exited; its pipe tells whether it reported first
            try:
                results[rank] = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                pass  # died without a result (or in the middle of sending it)
            del pending[rank]
        now = time.monotonic()
        failed = any(p.exitcode not in (None, 0) for p in procs) or any(
            r is not None and r[0] == "error" for r in results)
        if failed and failed_at is None:
            failed_at = now
        if failed_at is not None and now - failed_at > 0.5:
            break
        if deadline is not None and now > deadline:
            return results, True
    return results, False


def spawn_local(world: int, fn: Callable, *args: Any, timeout: float | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` local ranks and return every rank's result, by rank.

    Raises the failing rank's user error (same type and message), ``RankFailed`` for anything
    else, and ``TimeoutError`` past ``timeout`` seconds. ``KeyboardInterrupt`` in the parent
    stops every rank before it propagates.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    # Plain pickle (tensors by value): every rank loads the same bytes, and shared-memory
    # handles would be good for one of them only.
    work = pickle.dumps((fn, args))
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, os.getpid(), pipes[r][1], list(warnings.filters), work),
                    daemon=True)
        for r in range(world)
    ]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        for p, (_, send_end) in zip(procs, pipes):
            p.start()
            send_end.close()  # the parent only reads: a rank's death then shows as end-of-file
        results, timed_out = _collect(procs, [recv for recv, _ in pipes], deadline)
    finally:
        stopped = _stop(procs)
        for recv, _ in pipes:
            recv.close()
    if timed_out:
        raise TimeoutError(f"the {world} ranks did not finish within {timeout:.0f} s")
    return _outcome(procs, results, stopped)


def _outcome(procs: list[Any], results: list[Any], stopped: set[int]) -> list[Any]:
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
