#!/usr/bin/env python
"""How much faster can TP=2 on two single-threaded ranks be than one process with two threads?

Issue 10 asks TP=2 for ≥ 1.3× Hugging Face with the factor pairs on one process and two threads.
Both run the same matrix products of a decode step: HF all of them with two threads per product,
TP=2 each rank its shards with one thread, the two ranks at the same time. This script times
exactly that, with nothing else — no layers, no Python per module, no collectives — on the
products of one decode step (the layout's ``Cost.gemms`` per layer and the output layer, real
weight tensors, one per matrix, read in a step's order), median of a few steps:

- ``1 × 1``: every product of the TP=1 step, one thread (the HF 1 × 1 and TP=1 rows);
- ``1 × 2``: the same with two threads (what HF 1 × 2 has for its matrix products);
- ``2 × 1``: two processes pinned to one core each, each timing its rank's TP=2 products, started
  together (the slower rank's median: a step waits for it);
- ``rank 0 alone``: rank 0's TP=2 products in one process, one thread, nothing beside it — as
  the cost table times each shape; ``2 × 1`` over it is what the two ranks lose to each other
  (memory bandwidth, the shared last-level cache, and whatever the host's core mapping shares).

``1 × 2 ÷ 2 × 1`` is the most that TP=2 can gain over HF 1 × 2 from the matrix products; the
framework time beside them is paid by every rank of a TP job in full, and once by HF.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/check_core_scaling.py \\
        [--layout naive] [--batch 8] [--dtype float32]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from typing import Any

import torch

from deinfer_megatron.arch.model import transformer_config
from deinfer_megatron.decompose.allocation import uniform_ranks
from deinfer_megatron.models.synthetic import synthetic_arch
from deinfer_megatron.parallel.topology import TPView
from deinfer_megatron.planning.pricing import layout_costs, output_gemm
from deinfer_megatron.planning.calibrate import _product
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig


def step_gemms(args: argparse.Namespace, tp: int, rank: int) -> list[Any]:
    """The matrix products of one decode step on ``rank`` of ``tp`` (``planning.auto``'s list)."""
    arch = synthetic_arch(args.model)
    ranks = RankConfig.from_mapping(uniform_ranks(arch, args.ratio), arch)
    config = transformer_config(arch, tp=tp, pp=1)
    return [g for layer in ranks.layers for cost in layout_costs(config, arch, Layout(args.layout), layer, TPView(rank, tp))
            for g in cost.gemms] + [output_gemm(arch, tp)]


def time_step(gemms: list[Any], args: argparse.Namespace, threads: int, start_at: float = 0.0) -> float:
    """Median seconds of one pass over ``gemms`` (each its own weights, from memory)."""
    torch.set_num_threads(threads)
    dtype = getattr(torch, args.dtype)
    weights = [torch.empty((g.count, g.k, g.n) if g.count > 1 else ((g.n, g.k) if g.transposed else (g.k, g.n)))
               .uniform_(-1, 1).to(dtype) for g in gemms]
    ops = [(_product(g), torch.randn(*((g.count,) if g.count > 1 else ()), args.batch, g.k).to(dtype)) for g in gemms]
    while time.time() < start_at:  # the two ranks start their timed passes together
        time.sleep(1e-3)
    times = []
    with torch.no_grad():
        for _ in range(args.steps + 1):
            t0 = time.perf_counter()
            for (op, x), w in zip(ops, weights):
                op(x, w)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _rank(rank: int, args: argparse.Namespace, start_at: float, queue: Any) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    queue.put((rank, time_step(step_gemms(args, 2, rank), args, 1, start_at)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-1b-shape")
    parser.add_argument("--ratio", type=float, default=0.6)
    parser.add_argument("--layout", default="naive", choices=[l.value for l in Layout])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    whole = step_gemms(args, 1, 0)
    one = time_step(whole, args, 1)
    two_threads = time_step(whole, args, 2)
    alone = time_step(step_gemms(args, 2, 0), args, 1)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    start_at = time.time() + 5.0  # both ranks have built their weights by then
    procs = [ctx.Process(target=_rank, args=(r, args, start_at, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    ranks = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    tp2 = max(ranks.values())
    print(f"{args.model} ratio {args.ratio} {args.layout} batch {args.batch} {args.dtype}: one decode step's "
          f"{len(whole)} matrix products")
    print("| run | matrix products ms |")
    print("|---|---|")
    print(f"| 1 process × 1 thread (TP=1 step) | {one * 1e3:.2f} |")
    print(f"| 1 process × 2 threads (TP=1 step) | {two_threads * 1e3:.2f} |")
    print(f"| 2 processes × 1 thread (TP=2 ranks, together) | {tp2 * 1e3:.2f} "
          f"(ranks {ranks[0] * 1e3:.2f} / {ranks[1] * 1e3:.2f}) |")
    print(f"| 1 process × 1 thread (TP=2 rank 0 alone) | {alone * 1e3:.2f} |")
    print(f"two threads ÷ one: {one / two_threads:.2f}×; TP=2 ranks ÷ one thread: {one / tp2:.2f}×; "
          f"the most TP=2 gains over 1 × 2 from the products: {two_threads / tp2:.2f}×; "
          f"rank 0 beside rank 1 ÷ alone: {ranks[0] / alone:.2f}×")


if __name__ == "__main__":
    main()
