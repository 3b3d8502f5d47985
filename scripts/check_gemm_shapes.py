#!/usr/bin/env python
"""Does the cost model's per-shape GEMM time match the matrix products a decode step runs?

Calibrates (``calibrate.measure_shapes``) the shapes ``--layout auto`` prices for llama-1b-shape
at TP 2 and batch 1, 8, 32, then, for one layout on rank 0, prints the predicted GEMM time of a
step (every layer's blocks and the output layer, ``planning.auto.gemm_seconds``) beside a direct
timing of the same calls over the real weights of that rank, one distinct tensor per matrix, in
the order of a step (median of a few steps). ``--ranks 2`` times two ranks' worth of weights in
turn, as two ranks sharing the last-level cache read them. This checks the calibration, not the
framework: no layers, no collectives, one process.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/check_gemm_shapes.py [--layout deinfer]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deinfer_megatron.arch.model import transformer_config
from deinfer_megatron.decompose.allocation import uniform_ranks
from deinfer_megatron.models.synthetic import synthetic_arch
from deinfer_megatron.parallel.topology import TPView
from deinfer_megatron.planning.pricing import Workload, gemm_seconds, layout_costs, output_gemm, required_gemms
from deinfer_megatron.planning.calibrate import _product
from deinfer_megatron.planning.cost_model import CostTable, TableKey, with_shapes
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-1b-shape")
    parser.add_argument("--layout", default="deinfer")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.6)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--ranks", type=int, default=1, help="ranks' weights timed in turn")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    arch = synthetic_arch(args.model)
    ranks = RankConfig.from_mapping(uniform_ranks(arch, args.ratio), arch)
    batches = [int(b) for b in args.batches.split(",")]
    table = CostTable(TableKey.current(1), {}, 1.5e10)
    needs = set().union(*(required_gemms(arch, ranks, Workload(tp=args.tp, batch=b)) for b in batches))
    t0 = time.perf_counter()
    table = with_shapes(table, "float32", needs)
    print(f"calibrated {len({g for g, _ in needs})} shapes × {len(batches)} batch sizes in "
          f"{time.perf_counter() - t0:.1f} s")

    config = transformer_config(arch, tp=args.tp, pp=1)
    layout = Layout(args.layout)
    gemms = [g for layer in ranks.layers for cost in layout_costs(config, arch, layout, layer, TPView(0, args.tp))
             for g in cost.gemms] + [output_gemm(arch, args.tp)]
    weights = [[torch.empty((g.count, g.k, g.n) if g.count > 1 else ((g.n, g.k) if g.transposed else (g.k, g.n)))
                .uniform_(-1, 1) for g in gemms] for _ in range(args.ranks)]
    mib = sum(w.numel() for per in weights for w in per) * 4 / 2**20
    print(f"{args.model} tp={args.tp} {layout.value} rank 0: {len(gemms)} matrix products, "
          f"{mib:.0f} MiB of weights timed ({args.ranks} rank(s))")
    print("| batch | predicted GEMM ms | direct ms | predicted / direct |")
    print("|---|---|---|---|")
    with torch.no_grad():
        for b in batches:
            predicted = gemm_seconds(table, Workload(tp=args.tp, batch=b), tuple(gemms))
            xs = {g: torch.randn(*((g.count,) if g.count > 1 else ()), b, g.k) for g in gemms}
            ops = [(_product(g), xs[g]) for g in gemms]
            times = []
            for _ in range(args.steps + 1):
                start = time.perf_counter()
                for per in weights:
                    for (op, x), w in zip(ops, per):
                        op(x, w)
                times.append((time.perf_counter() - start) / args.ranks)
            direct = statistics.median(times[1:])
            print(f"| {b} | {predicted * 1e3:.2f} | {direct * 1e3:.2f} | {predicted / direct:.2f} |")


if __name__ == "__main__":
    main()
