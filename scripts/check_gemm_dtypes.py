#!/usr/bin/env python
"""Is bfloat16 worth asking for on this CPU? float32 against bfloat16 matrix products at the
shapes of a SmolLM2-135M decode step.

For each row count (1: one request; 16: a served step) and each (in, out) shape of the model's
matrices and of typical factors, times ``F.linear`` with Megatron's ``(out, in)`` weight and
``x @ W`` with the ``(in, out)`` weight the project's factors hold (``layers/factors.py``), in
both dtypes, medians of 7 rounds. A CPU with AVX-512 BF16 or AMX runs bfloat16 natively (the
products' gain in docs/BENCHMARKS.md); elsewhere oneDNN emulates it, and the jobs warn
(``runtime.options.DType.native``). One process, no model, nothing written.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/check_gemm_dtypes.py [--rows 1 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from deinfer_megatron.runtime.options import DType

SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192), (576, 300), (300, 1536))  # (in, out)


def median_us(call: Callable[[], object], calls: int = 100, rounds: int = 7) -> float:
    for _ in range(10):
        call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    args = p.parse_args()
    print(f"bfloat16 native here: {DType.BFLOAT16.native}; torch threads {torch.get_num_threads()}")
    print("| rows | in | out | float32 linear us | bfloat16 linear us | ratio | float32 x@W us | bfloat16 x@W us | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        for k, n in SHAPES:
            t = {}
            for dt in (torch.float32, torch.bfloat16):
                x, w = torch.randn(rows, k, dtype=dt), torch.randn(n, k, dtype=dt)
                wt = w.t().contiguous()
                t[dt] = (median_us(lambda: F.linear(x, w)), median_us(lambda: x @ wt))
            f, b = t[torch.float32], t[torch.bfloat16]
            print(f"| {rows} | {k} | {n} | {f[0]:.0f} | {b[0]:.0f} | {f[0] / b[0]:.2f} | {f[1]:.0f} | {b[1]:.0f} "
                  f"| {f[1] / b[1]:.2f} |")
    print("ratio: float32 time / bfloat16 time (above 1: bfloat16 faster)")


if __name__ == "__main__":
    main()
