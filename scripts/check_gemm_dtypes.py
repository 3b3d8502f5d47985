#!/usr/bin/env python
"""Is bfloat16 worth asking for on this CPU? float32 against bfloat16 matrix products at the
shapes of a SmolLM2-135M decode step.

For each row count (1: one request; 16: a served step) and each (in, out) shape of the model's
matrices and of typical factors, times ``F.linear`` with Megatron's ``(out, in)`` weight and
``x @ W`` with the ``(in, out)`` weight the project's factors hold (``layers/factors.py``), in
both dtypes, with the cost model's own timer (``planning.calibrate.measure_shapes``: weights read
from memory as a step reads them, the median of its rounds). A CPU with AVX-512 BF16 or AMX runs
bfloat16 natively (the products' gain in docs/BENCHMARKS.md); elsewhere oneDNN emulates it, and
the jobs warn (``runtime.options.DType.native``). One process, no model, nothing written.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/check_gemm_dtypes.py [--rows 1 16]
"""

from __future__ import annotations

import argparse

import torch

from deinfer_megatron.layers.costs import Gemm
from deinfer_megatron.planning.calibrate import measure_shapes
from deinfer_megatron.runtime.options import DType

SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192), (576, 300), (300, 1536))  # (in, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    args = p.parse_args()
    threads = torch.get_num_threads()
    print(f"bfloat16 native here: {DType.BFLOAT16.native}; torch threads {threads}")
    print("| rows | in | out | float32 linear us | bfloat16 linear us | ratio | float32 x@W us | bfloat16 x@W us | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    gemms = [Gemm(k, n, transposed=transposed) for k, n in SHAPES for transposed in (True, False)]
    needs = [(g, rows) for g in gemms for rows in args.rows]
    us = {dt: {(g, int(rows)): s * 1e6 for g, timed in measure_shapes(dt, needs, threads=threads).items()
               for rows, s in timed}
          for dt in ("float32", "bfloat16")}
    f, b = us["float32"], us["bfloat16"]
    for rows in args.rows:
        for k, n in SHAPES:
            lin, mm = ((Gemm(k, n, transposed=t), rows) for t in (True, False))
            print(f"| {rows} | {k} | {n} | {f[lin]:.0f} | {b[lin]:.0f} | {f[lin] / b[lin]:.2f} | {f[mm]:.0f} "
                  f"| {b[mm]:.0f} | {f[mm] / b[mm]:.2f} |")
    print("ratio: float32 time / bfloat16 time (above 1: bfloat16 faster)")


if __name__ == "__main__":
    main()
