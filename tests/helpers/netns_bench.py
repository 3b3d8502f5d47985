"""Bench cells with TP=2 across two "nodes": rank 0 in one network namespace, rank 1 in the
other, joined by a veth pair limited to a given rate (``tests/helpers/netns.py``; root needed).

The cells are the bench's own (``bench.matrix`` grid, ``bench.measure.cell_worker`` in each
rank, the same summaries and speed-ups as ``deinfer-megatron bench``); only the runner differs:
instead of two local ranks (whose collectives go through shared memory), each rank is a process
started with ``ip netns exec`` in its namespace, so every collective crosses the link. Each rank
is pinned to its own core, as the local runner does.

    sudo python -m tests.helpers.netns_bench --synthetic llama-tiny --rate 1gbit \\
        --layouts naive,deinfer --batch 8 --prompt-len 128 --gen-len 16 --repeats 3 [--json F]

``--rate`` is unlimited, 10gbit or 1gbit (tc tbf; no added delay: netem is not available), or
``local``: no namespaces, the bench's own local runner, with ``--collectives`` choosing shared
memory (``auto``, the default) or gloo (``process-group``) between the two local ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.helpers import netns

_RANK = """
import os, pickle, sys
from deinfer_megatron.bench.measure import cell_worker
job = pickle.loads(open(sys.argv[1], "rb").read())
result = pickle.dumps(cell_worker(job))
tmp = sys.argv[2] + ".tmp"
open(tmp, "wb").write(result)
os.replace(tmp, sys.argv[2])
"""


def namespace_runner(nodes: netns.TwoNodes, scratch: Path, timeout_s: float = 1800) -> Any:
    """A ``bench.matrix`` runner that starts rank r of a TP=2 cell in namespace r."""
    from deinfer_megatron.bench.matrix import random_prompts
    from deinfer_megatron.bench.measure import CellJob

    count = [0]

    def run(cell: Any, source: Any, grid: Any) -> list[Any]:
        if cell.tp != 2:
            raise ValueError(f"across two namespaces a cell needs --tp 2 (one rank per node), got {cell.tp}")
        count[0] += 1
        job = CellJob(source.folder_for(cell.layout), cell.layout, cell.kv_cache, cell.tp, cell.batch,
                      cell.prompt_len, grid.gen_len, grid.repeats,
                      random_prompts(source.arch.vocab_size, cell.batch, cell.prompt_len, grid.seed))
        job_file = scratch / f"cell{count[0]}.job"
        job_file.write_bytes(pickle.dumps(job))
        cpus = sorted(os.sched_getaffinity(0))
        procs, results = [], []
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=nodes.addr[0],
                       MASTER_PORT=str(29400 + count[0]), GLOO_SOCKET_IFNAME=nodes.dev[rank], OMP_NUM_THREADS="1")
            results.append(scratch / f"cell{count[0]}.rank{rank}")
            argv = [sys.executable, "-c", _RANK, str(job_file), str(results[-1])]
            if len(cpus) >= 2:
                argv = ["taskset", "-c", str(cpus[rank]), *argv]
            procs.append(nodes.popen(rank, argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errors = []
        for rank, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"the cell did not finish within {timeout_s:.0f} s") from None
            if proc.returncode != 0:
                lines = [line for line in err.splitlines() if line.strip()]
                errors.append(f"rank {rank} exited {proc.returncode}: {lines[-1] if lines else ''}")
        if errors:
            raise RuntimeError("; ".join(errors))
        return [pickle.loads(path.read_bytes()) for path in results]

    return run


def local_runner(collectives: str) -> Any:
    """The bench's local runner (two spawned ranks on this machine) with a chosen transport."""
    from deinfer_megatron.bench.matrix import random_prompts
    from deinfer_megatron.bench.measure import CellJob, cell_worker
    from deinfer_megatron.launch.local import spawn_local

    def run(cell: Any, source: Any, grid: Any) -> list[Any]:
        job = CellJob(source.folder_for(cell.layout), cell.layout, cell.kv_cache, cell.tp, cell.batch,
                      cell.prompt_len, grid.gen_len, grid.repeats,
                      random_prompts(source.arch.vocab_size, cell.batch, cell.prompt_len, grid.seed),
                      collectives=collectives)
        return spawn_local(cell.tp, cell_worker, job, timeout=grid.cell_timeout_s)

    return run


def main(argv: list[str] | None = None) -> int:
    from deinfer_megatron.bench import matrix, report
    from deinfer_megatron.bench.records import CellStatus
    from deinfer_megatron.bench.sources import synthetic_source
    from deinfer_megatron.layers.kv_cache import CacheKind
    from deinfer_megatron.specs.layout import Layout

    p = argparse.ArgumentParser(prog="python -m tests.helpers.netns_bench", description=__doc__.split("\n")[0])
    p.add_argument("--synthetic", default="llama-tiny")
    p.add_argument("--ratio", type=float, default=0.6)
    p.add_argument("--rate", choices=(*netns.RATES, "local"), default="1gbit")
    p.add_argument("--collectives", choices=("auto", "process-group"), default="auto", help="--rate local only")
    p.add_argument("--layouts", default="naive,deinfer")
    p.add_argument("--batch", default="8")
    p.add_argument("--prompt-len", default="128")
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    reason = netns.unavailable() if a.rate != "local" else None
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    grid = matrix.BenchGrid(synthetic=a.synthetic, ratio=a.ratio,
                            layouts=tuple(Layout.parse(x) for x in a.layouts.split(",")),
                            kv_caches=(CacheKind.FULL,), tps=(2,),
                            batches=tuple(int(x) for x in a.batch.split(",")),
                            prompt_lens=tuple(int(x) for x in a.prompt_len.split(",")),
                            gen_len=a.gen_len, repeats=a.repeats)
    with tempfile.TemporaryDirectory(prefix="deinfer-netns-bench-") as work:
        scratch = Path(work)
        source = synthetic_source(a.synthetic, a.ratio, 0, scratch)
        if a.rate == "local":
            records = matrix.run_matrix(grid, source, runner=local_runner(a.collectives), progress=False)
        else:
            with netns.two_nodes(netns.RATES[a.rate]) as nodes:
                records = matrix.run_matrix(grid, source, runner=namespace_runner(nodes, scratch), progress=False)
    records = [report.summarize(r) if r.status is CellStatus.OK else r for r in records]
    records, comparisons = report.compare(records)
    print("TP=2 on this machine, collectives " + a.collectives if a.rate == "local"
          else f"TP=2 across two network namespaces, link {a.rate}")
    print(report.text_table(records))
    for c in comparisons:
        print(f"batch {c.batch} ctx {c.prompt_len}: deinfer {c.deinfer_tokens_per_s:.1f} tok/s, "
              f"vs naive {c.speedups.vs_naive or float('nan'):.2f}×")
    for r in records:
        if r.status is CellStatus.ERROR:
            print(f"failed: {r.cell.label()}: {r.error}", file=sys.stderr)
    if a.json is not None:
        doc = {"rate": a.rate, "collectives": a.collectives, "cells": [r.to_json() for r in records],
               "comparisons": [c.to_json() for c in comparisons], "load_avg": os.getloadavg()}
        report.write_atomic(a.json, json.dumps(doc, indent=1))
    return 1 if any(r.status is CellStatus.ERROR for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
