"""Latency of the tensor-parallel collectives per element count: shared memory against gloo.

Two local ranks (one core each) issue all-reduces and all-gathers of 1 .. 1M float32 elements
through the project's named operations (``parallel.comm``) — once with the transport chosen at
group setup (shared memory, ``parallel.shm``), once with that group routed back to gloo, in
alternating rounds so that load on a shared machine hits both alike. Each round times
``iters`` calls after a barrier; the median of the rounds is reported (noisy hosts: medians).

Run: ``python -m deinfer_megatron.bench.transports [--max-elements N] [--rounds R] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from deinfer_megatron.files.staging import write_atomic
from deinfer_megatron.launch.local import spawn_local
from deinfer_megatron.parallel import comm
from deinfer_megatron.parallel.runtime import init_parallel, shutdown
from deinfer_megatron.parallel.topology import TPView

SIZES = tuple(4**k for k in range(11))  # 1 .. 1,048,576 elements
KINDS = ("all_reduce", "all_gather")


def _round_s(kind: str, elements: int, tp: Any, iters: int) -> float:
    if kind == "all_reduce":
        x = torch.ones(1, elements)
        op = lambda: comm.all_reduce_sum(x, tp, site="bench", layer=0)  # noqa: E731
    else:  # the gathered result has ``elements`` elements, as the ledger counts it
        chunk = torch.ones(1, max(1, -(-elements // tp.size)))
        op = lambda: comm.all_gather_last_dim(chunk, tp, site="bench", layer=0)  # noqa: E731
    op()
    comm.barrier(tp)
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    return (time.perf_counter() - t0) / iters


def worker(sizes: tuple[int, ...], rounds: int, iters: int) -> dict[str, Any] | None:
    """On each of 2 ranks; rank 0 returns ``{transport: {kind: {elements: median seconds}}}``."""

    groups = init_parallel(2, 1)
    try:
        tp = TPView.of(groups.pg_collection.tp)
        chosen = comm.transport_of(tp.group)
        transports = {groups.transport.kind: chosen, "gloo": None} if chosen is not None else {"gloo": None}
        samples: dict[str, dict[str, dict[int, list[float]]]] = {
            t: {k: {n: [] for n in sizes} for k in KINDS} for t in transports}
        for _ in range(rounds):
            for name, transport in transports.items():
                comm.use_transport(tp.group, transport)
                for kind in KINDS:
                    for n in sizes:
                        samples[name][kind][n].append(_round_s(kind, n, tp, iters))
        comm.use_transport(tp.group, chosen)
    finally:
        shutdown()
    if groups.tp_rank != 0:
        return None
    return {t: {k: {str(n): statistics.median(v) for n, v in per.items()} for k, per in kinds.items()}
            for t, kinds in samples.items()}


def markdown(result: dict[str, Any]) -> str:
    """One table: microseconds per collective for each transport, and gloo ÷ shared memory."""
    names = list(result)
    fast = names[0]
    lines = ["| collective | elements | " + " | ".join(f"{t} µs" for t in names) + " | gloo ÷ " + fast + " |",
             "|---|---|" + "---|" * (len(names) + 1)]
    for kind in KINDS:
        for n in result[fast][kind]:
            us = [result[t][kind][n] * 1e6 for t in names]
            ratio = result["gloo"][kind][n] / result[fast][kind][n]
            lines.append(f"| {kind} | {n} | " + " | ".join(f"{u:.1f}" for u in us) + f" | {ratio:.1f}× |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deinfer_megatron.bench.transports", description=__doc__.split("\n")[0])
    p.add_argument("--max-elements", type=int, default=SIZES[-1])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", help="also write the medians (seconds) to this file")
    a = p.parse_args(argv)
    if a.max_elements < 1 or a.rounds < 1 or a.iters < 1:
        print("error: --max-elements, --rounds and --iters must be at least 1", file=sys.stderr)
        return 2
    sizes = tuple(n for n in SIZES if n <= a.max_elements)
    result = spawn_local(2, worker, sizes, a.rounds, a.iters)[0]
    print(markdown(result), end="")
    if a.json:
        from pathlib import Path

        write_atomic(Path(a.json), json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
