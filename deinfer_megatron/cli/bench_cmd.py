"""``deinfer-megatron bench``: time the layouts on the same weights over a configuration grid.

Every (layout, KV cache, TP, batch, prompt length) cell runs in fresh ranks with the project's
own generation loop; the report has per-repeat timings, peak RSS, KV bytes and the collectives
of one decode step (checked against the planner), and optionally a roofline bound.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deinfer_megatron.bench.matrix import BenchConfig

DEFAULT_RATIO = 0.6


def _ints(flag: str) -> Any:
    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers, e.g. 1,2") from None
    return parse


def _names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time dense / naive / DeInfer over layouts, TP, batch and context")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="model folder (dense: dense layout only; or decomposed)")
    src.add_argument("--synthetic", help="random LLaMA-shaped model: llama-tiny, llama-1b-shape, llama-7b-shape")
    p.add_argument("--ratio", type=float, help=f"--synthetic: parameters kept, uniform ranks (default {DEFAULT_RATIO})")
    p.add_argument("--layouts", type=_names, default=("dense", "naive", "deinfer"), help="default dense,naive,deinfer")
    p.add_argument("--kv-cache", type=_names, default=("full",), help="full,latent (latent: deinfer only)")
    p.add_argument("--tp", type=_ints("--tp"), default=(1, 2), help="default 1,2")
    p.add_argument("--batch", type=_ints("--batch"), default=(1, 8, 32), help="default 1,8,32")
    p.add_argument("--prompt-len", type=_ints("--prompt-len"), default=(128,), help="default 128")
    p.add_argument("--gen-len", type=int, default=32, help="new tokens per row (no EOS stop)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up; medians reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="every raw sample and the summaries")
    p.add_argument("--markdown", type=Path, help="the tables as Markdown")
    p.add_argument("--plot", type=Path, help="PNG: decode tokens/s vs batch per TP, elements per token")
    p.add_argument("--roofline", action="store_true", help="measure copy/GEMM/collective rates; bound each step")
    p.add_argument("--cell-timeout", type=float, default=1800.0, help="seconds before a cell is recorded as failed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(make_config=config_from_args, run=main)


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    if a.ratio is not None and a.model is not None:
        raise ValueError("--ratio applies to --synthetic; decompose the folder with "
                         "`deinfer-megatron decompose --ratio R` and bench the decomposed folder")
    return BenchConfig(
        model=a.model, synthetic=a.synthetic, ratio=DEFAULT_RATIO if a.ratio is None else a.ratio,
        layouts=a.layouts, kv_caches=a.kv_cache, tps=a.tp, batches=a.batch, prompt_lens=a.prompt_len,
        gen_len=a.gen_len, repeats=a.repeats, seed=a.seed, json=a.json, markdown=a.markdown, plot=a.plot,
        roofline=a.roofline, cell_timeout_s=a.cell_timeout, progress=not a.no_progress)


def _check_outputs(cfg: BenchConfig) -> None:
    for flag, path in (("--json", cfg.json), ("--markdown", cfg.markdown), ("--plot", cfg.plot)):
        if path is not None and not path.resolve().parent.is_dir():
            raise ValueError(f"{flag} {path}: directory {path.resolve().parent} does not exist; create it first")


def _host(start_load: tuple[float, ...], started: str) -> dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "1")),
            "load_avg_start": [round(x, 2) for x in start_load],
            "load_avg_end": [round(x, 2) for x in os.getloadavg()],
            "started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _source(cfg: BenchConfig, workdir: Path) -> Any:
    from deinfer_megatron.bench.sources import folder_source, synthetic_source
    from deinfer_megatron.models.build import check_parallel_sizes
    from deinfer_megatron.models.synthetic import synthetic_arch

    if cfg.synthetic is None:
        return folder_source(cfg.model)
    for tp in cfg.tps:  # before drawing a model that may take a while to write
        check_parallel_sizes(synthetic_arch(cfg.synthetic), tp, 1)
    print(f"drawing {cfg.synthetic} (ratio {cfg.ratio:g}) into {workdir} ...", file=sys.stderr)
    return synthetic_source(cfg.synthetic, cfg.ratio, cfg.seed, workdir)


def main(cfg: BenchConfig) -> int:
    from deinfer_megatron.bench import matrix, report, roofline

    matrix.check_config(cfg)
    _check_outputs(cfg)
    start_load, started = os.getloadavg(), time.strftime("%Y-%m-%dT%H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="deinfer-bench-") as work:
        source = _source(cfg, Path(work))
        matrix.check_sizes(cfg, source)
        matrix.require_runnable(cfg, source)
        machine = None
        if cfg.roofline:
            print("measuring copy bandwidth, GEMM rate and collective latency ...", file=sys.stderr)
            machine = roofline.measure_machine(roofline.sizes_for(source.arch, cfg.batches))
        records = matrix.run_matrix(cfg, source)
    for rec in records:
        if rec["status"] == "ok":
            report.summarize(rec)
            if machine is not None:
                rec["roofline"] = roofline.step_bound(rec, source.arch, machine)
    doc = report.document(cfg, source, records, machine, _host(start_load, started))
    if cfg.json is not None:
        import json

        report.write_atomic(cfg.json, json.dumps(doc, indent=1))
    if cfg.markdown is not None:
        report.write_atomic(cfg.markdown, report.markdown(doc))
    if cfg.plot is not None:
        from deinfer_megatron.bench.plot import render_png

        report.write_atomic(cfg.plot, render_png(doc))
    print(report.text_table(records))
    for line in report.roofline_lines(records):
        print(line)
    failed = [r for r in records if r["status"] == "error"]
    for r in failed:
        print(f"failed: {r['layout']}/{r['kv_cache']} tp={r['tp']} b={r['batch']} ctx={r['prompt_len']}: "
              f"{r['error']}", file=sys.stderr)
    return 1 if failed else 0
