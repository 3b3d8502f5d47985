"""Bench cells with TP=2 across two "nodes": rank 0 in one network namespace, rank 1 in the
other, joined by a veth pair limited to a given rate (``tests/helpers/netns.py``; root needed).

The cells are the bench's own (``bench.matrix`` grid, ``bench.measure.cell_worker`` in each
rank, the same summaries and speed-ups as ``deinfer-megatron bench``); only the runner differs:
instead of two local ranks (whose collectives go through shared memory), each rank is a process
started with ``ip netns exec`` in its namespace, so every collective crosses the link. Each rank
is pinned to its own core, as the local runner does.

    sudo python -m tests.helpers.netns_bench --synthetic llama-tiny --rate 1gbit \\
        --layouts auto,naive,deinfer --batch 8 --prompt-len 128 --gen-len 16 --repeats 3 [--predict] [--json F]

Before the cells it measures the link (``measure_link``: what a launched ``--layout auto`` job
measures in its ranks) and prices ``auto`` cells and ``--predict`` with those rates
(``BenchGrid.collectives``), so ``auto`` chooses for the link, not for shared memory.

``--rate`` is unlimited, 10gbit or 1gbit (tc tbf; no added delay: netem is not available), or
``local``: no namespaces, the bench's own local runner, with ``--collectives`` choosing shared
memory (``auto``, the default) or gloo (``process-group``) between the two local ranks; across
the namespaces ``--collectives`` chooses all-reduces as all-gather + sum (``auto``) or gloo's
own collectives.

``--transports MAX_ELEMENTS`` measures no cells: the latency of one all-reduce and one all-gather
per element count across the link, gather + sum against gloo (``bench.transports`` in
the two namespaces; ``--repeats`` rounds of 20 calls, medians).
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
from deinfer_megatron.bench.measure import measure_cell
from deinfer_megatron.runtime.job import run_prepared
prepared = pickle.loads(open(sys.argv[1], "rb").read())
result = pickle.dumps(run_prepared(prepared, measure_cell))
tmp = sys.argv[2] + ".tmp"
open(tmp, "wb").write(result)
os.replace(tmp, sys.argv[2])
"""


_LINK = """
import json, os, sys
from deinfer_megatron.parallel.runtime import init_parallel, shutdown
from deinfer_megatron.parallel.topology import TPView
from deinfer_megatron.runtime.agree import measure_tp_collectives
groups = init_parallel(2, 1, collectives=sys.argv[1])
try:
    link = measure_tp_collectives(TPView(groups.tp_rank, 2, groups.pg_collection.tp), groups.device)
finally:
    shutdown()
tmp = sys.argv[2] + ".tmp"
open(tmp, "w").write(json.dumps(link))
os.replace(tmp, sys.argv[2])
"""

_TRANSPORTS = """
import json, sys
from deinfer_megatron.files.staging import write_atomic
from deinfer_megatron.bench.transports import SIZES, worker
result = worker(tuple(n for n in SIZES if n <= int(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
write_atomic(sys.argv[4], json.dumps(result))
"""


class Pair:
    """Starts one process per namespace (rank r in namespace r, pinned to its own core) with the
    launcher's variables, and collects what each wrote to its result file."""

    def __init__(self, nodes: netns.TwoNodes, scratch: Path, timeout_s: float = 1800) -> None:
        self.nodes, self.scratch, self.timeout_s, self.count = nodes, scratch, timeout_s, 0

    def run(self, script: str, *args: str) -> list[Path]:
        """Both ranks of ``python -c script *args <result file>``; the result files, by rank."""
        self.count += 1
        cpus = sorted(os.sched_getaffinity(0))
        procs, results = [], []
        for rank in (0, 1):
            env = self.nodes.launcher_env(rank, 29400 + self.count)
            results.append(self.scratch / f"run{self.count}.rank{rank}")
            argv = [sys.executable, "-c", script, *args, str(results[-1])]
            if len(cpus) >= 2:
                argv = ["taskset", "-c", str(cpus[rank]), *argv]
            procs.append(self.nodes.popen(rank, argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True))
        errors = []
        for rank, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"the ranks did not finish within {self.timeout_s:.0f} s") from None
            if proc.returncode != 0:
                lines = [line for line in err.splitlines() if line.strip()]
                errors.append(f"rank {rank} exited {proc.returncode}: {lines[-1] if lines else ''}")
        if errors:
            raise RuntimeError("; ".join(errors))
        return results


def measure_link(pair: Pair, collectives: str = "auto") -> dict[str, list[float]]:
    """The TP group's collectives across the link (``runtime.agree.measure_tp_collectives``, what
    a launched ``--layout auto`` job measures in its ranks): what ``auto`` and ``--predict`` price."""
    return json.loads(pair.run(_LINK, collectives)[0].read_text())


def transports_across(pair: Pair, max_elements: int, rounds: int, iters: int) -> dict[str, Any]:
    """``bench.transports`` with one rank per namespace: the transport ``auto`` installs across the
    link (all-reduce as all-gather + sum) against gloo's own collectives, rank 0's medians."""
    return json.loads(pair.run(_TRANSPORTS, str(max_elements), str(rounds), str(iters))[0].read_text())


def namespace_runner(pair: Pair) -> Any:
    """A ``bench.matrix`` runner that starts rank r of a prepared TP=2 cell in namespace r, each
    a launched rank of the runtime (its plan, an ``auto`` cell's priced with ``grid.collectives``,
    the link's measured rates, came prepared); rank 0 writes every rank's measurements."""
    def run(prepared: Any, grid: Any) -> list[Any]:
        if prepared.spec.tp != 2:
            raise ValueError(f"across two namespaces a cell needs --tp 2 (one rank per node), got {prepared.spec.tp}")
        job_file = pair.scratch / f"cell{pair.count + 1}.job"
        job_file.write_bytes(pickle.dumps(prepared))
        return pickle.loads(pair.run(_RANK, str(job_file))[0].read_bytes())

    return run


def _tokens_per_s(records: list[Any]) -> dict[tuple[int, int], dict[str, float]]:
    """Decode tokens/s per (batch, prompt length) and layout name of the measured cells."""
    out: dict[tuple[int, int], dict[str, float]] = {}
    for r in records:
        if r.summary is not None:
            out.setdefault((r.cell.batch, r.cell.prompt_len), {})[r.cell.layout_name] = r.summary.decode_tokens_per_s
    return out


def main(argv: list[str] | None = None) -> int:
    from deinfer_megatron.bench import matrix, report
    from deinfer_megatron.bench.records import CellStatus
    from deinfer_megatron.bench.sources import synthetic_source
    from deinfer_megatron.layers.kv_cache import CacheKind
    from deinfer_megatron.cli.bench_cmd import profiled_and_predicted
    from deinfer_megatron.files.staging import write_atomic
    from deinfer_megatron.planning.request import AUTO, LayoutRequest

    p = argparse.ArgumentParser(prog="python -m tests.helpers.netns_bench", description=__doc__.split("\n")[0])
    p.add_argument("--synthetic", default="llama-tiny")
    p.add_argument("--ratio", type=float, default=0.6)
    p.add_argument("--rate", choices=(*netns.RATES, "local"), default="1gbit")
    p.add_argument("--collectives", choices=("auto", "process-group"), default="auto",
                   help="what carries the TP collectives: shared memory (local) or all-gather + sum "
                        "(across the link), or gloo's own")
    p.add_argument("--layouts", default="naive,deinfer")
    p.add_argument("--batch", default="8")
    p.add_argument("--prompt-len", default="128")
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--predict", action="store_true",
                   help="the cost model's step beside every cell, priced with the link's measured collectives")
    p.add_argument("--json", type=Path)
    p.add_argument("--transports", type=int, metavar="MAX_ELEMENTS",
                   help="instead of bench cells: collective latency per element count across the link, "
                        "gather + sum against gloo (bench.transports), up to MAX_ELEMENTS")
    a = p.parse_args(argv)
    reason = netns.unavailable() if a.rate != "local" else None
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    if a.transports is not None and a.rate == "local":
        print("error: --transports measures across the namespaces; for local ranks run "
              "python -m deinfer_megatron.bench.transports", file=sys.stderr)
        return 2
    if a.transports is not None and (a.transports < 1 or a.repeats < 1):
        print("error: --transports and --repeats must be at least 1", file=sys.stderr)
        return 2
    if a.transports is not None:
        from deinfer_megatron.bench.transports import markdown

        with netns.two_nodes(netns.RATES[a.rate]) as nodes, tempfile.TemporaryDirectory(prefix="deinfer-netns-") as work:
            result = transports_across(Pair(nodes, Path(work)), a.transports, a.repeats, 20)
        print(f"link {a.rate}, {a.repeats} rounds of 20 calls, median µs per collective")
        print(markdown(result), end="")
        if a.json is not None:
            write_atomic(a.json, json.dumps(result, indent=1))
        return 0
    grid = matrix.BenchGrid(synthetic=a.synthetic, ratio=a.ratio,
                            layouts=tuple(LayoutRequest.parse(x) for x in a.layouts.split(",")),
                            kv_caches=(CacheKind.FULL,), tps=(2,),
                            batches=tuple(int(x) for x in a.batch.split(",")),
                            prompt_lens=tuple(int(x) for x in a.prompt_len.split(",")),
                            gen_len=a.gen_len, repeats=a.repeats, transport=a.collectives)
    with tempfile.TemporaryDirectory(prefix="deinfer-netns-bench-") as work:
        scratch = Path(work)
        source = synthetic_source(a.synthetic, a.ratio, 0, scratch)
        if a.rate == "local":
            records = matrix.run_matrix(grid, matrix.prepare_cells(grid, source), progress=False)
        else:
            with netns.two_nodes(netns.RATES[a.rate]) as nodes:
                pair = Pair(nodes, scratch)
                if LayoutRequest.auto() in grid.layouts or a.predict:
                    grid = replace(grid, collectives=measure_link(pair, a.collectives))
                    print("the link's collectives: " + ", ".join(
                        f"{k} {v[0] * 1e6:.0f} us + {v[1] / 1e9:.3f} GB/s" for k, v in grid.collectives.items()))
                records = matrix.run_matrix(grid, matrix.prepare_cells(grid, source), runner=namespace_runner(pair),
                                            progress=False)
        records = [report.summarize(r) if r.status is CellStatus.OK else r for r in records]
        if LayoutRequest.auto() in grid.layouts or a.predict:  # priced while the model is on disk
            records = profiled_and_predicted(replace(grid, predict=a.predict), source, records)
    records, comparisons = report.compare(records)
    print("TP=2 on this machine, collectives " + a.collectives if a.rate == "local"
          else f"TP=2 across two network namespaces, link {a.rate}, collectives {a.collectives}")
    print(report.text_table(records))
    for c in comparisons:
        print(f"batch {c.batch} ctx {c.prompt_len}: deinfer {c.deinfer_tokens_per_s:.1f} tok/s, "
              f"vs naive {c.speedups.vs_naive or float('nan'):.2f}×")
    for (batch, ctx), speeds in _tokens_per_s(records).items():
        if AUTO in speeds and len(speeds) > 1:
            best = max((v, k) for k, v in speeds.items() if k != AUTO)
            print(f"batch {batch} ctx {ctx}: auto {speeds[AUTO]:.1f} tok/s, {speeds[AUTO] / best[0]:.2f}× the best "
                  f"fixed layout ({best[1]})" + (f", {speeds[AUTO] / speeds['naive']:.2f}× naive" if "naive" in speeds else ""))
    for r in records:
        if r.prediction is not None:
            p = r.prediction
            print(f"{r.cell.label()}: predicted {p.predicted_s * 1e3:.1f} ms, measured {p.measured_s * 1e3:.1f} ms "
                  f"({p.predicted_over_measured:.2f}); plan {p.chosen}")
    for r in records:
        if r.status is CellStatus.ERROR:
            print(f"failed: {r.cell.label()}: {r.error}", file=sys.stderr)
    if a.json is not None:
        doc = {"rate": a.rate, "collectives": a.collectives, "link_collectives": grid.collectives, "cells": [r.to_json() for r in records],
               "comparisons": [c.to_json() for c in comparisons], "load_avg": os.getloadavg()}
        write_atomic(a.json, json.dumps(doc, indent=1))
    return 1 if any(r.status is CellStatus.ERROR for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
