"""``deinfer-megatron bench``: time the layouts on the same weights over a configuration grid.

Every (layout, KV cache, TP, batch, prompt length) cell runs in fresh ranks with the project's
own generation loop; the report has per-repeat timings, peak RSS, KV bytes and the collectives
of one decode step (checked against the planner), and optionally a roofline bound. ``--peers``
adds other implementations (Hugging Face, DeepSpeed AutoTP) beside the cells, in the same run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, TypeVar

from deinfer_megatron.bench import matrix, peers as peer_runs, prediction, profile, report, roofline
from deinfer_megatron.bench.matrix import BenchConfig, BenchGrid, BenchOutputs
from deinfer_megatron.bench.plot import render_png
from deinfer_megatron.bench.records import CellStatus, Peer
from deinfer_megatron.bench.sources import folder_source, synthetic_source
from deinfer_megatron.cli.arguments import names, parsed_by
from deinfer_megatron.files.staging import write_atomic
from deinfer_megatron.generation.prefill import DEFAULT_MAX_PREFILL_TOKENS
from deinfer_megatron.launch import allocator
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.models.synthetic import synthetic_arch
from deinfer_megatron.parallel.topology import check_parallel_sizes
from deinfer_megatron.planning.request import LayoutRequest, choices
from deinfer_megatron.runtime.options import DType
from deinfer_megatron.specs.layout import latent_cache_layouts

T = TypeVar("T")

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


def _layouts(values: tuple[str, ...]) -> tuple[LayoutRequest, ...]:
    """``--layouts`` names: the fixed layouts and ``auto``."""
    return _members("--layouts", values, LayoutRequest.parse, choices())


def _members(flag: str, values: tuple[str, ...], parse: Callable[[str], T], names: list[str]) -> tuple[T, ...]:
    """Comma-list names as parsed values: ``parse`` decides what is known (its own message is
    replaced by one naming the flag and ``names``, as the list may hold several values)."""
    out = []
    for v in values:
        try:
            out.append(parse(v))
        except ValueError:
            raise ValueError(f"{flag}: unknown value {v!r}; choose from {','.join(names)}") from None
    return tuple(out)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time dense / naive / DeInfer over layouts, TP, batch and context")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="model folder (dense: dense layout only; or decomposed)")
    src.add_argument("--synthetic", help="random LLaMA-shaped model: llama-tiny, llama-1b-shape, llama-7b-shape")
    p.add_argument("--ratio", type=float, help=f"--synthetic: parameters kept, uniform ranks (default {DEFAULT_RATIO})")
    p.add_argument("--layouts", type=_names, default=tuple(choices()),
                   help=f"default {','.join(choices())} (auto: the cost model's layout per block, per cell)")
    p.add_argument("--kv-cache", type=_names, default=(CacheKind.FULL.value,),
                   help=f"full,latent (latent: {latent_cache_layouts()} only)")
    p.add_argument("--tp", type=_ints("--tp"), default=(1, 2), help="default 1,2")
    p.add_argument("--batch", type=_ints("--batch"), default=(1, 8, 32), help="default 1,8,32")
    p.add_argument("--prompt-len", type=_ints("--prompt-len"), default=(128,), help="default 128")
    p.add_argument("--gen-len", type=int, default=32, help="new tokens per row (no EOS stop)")
    p.add_argument("--max-prefill-tokens", type=int, default=DEFAULT_MAX_PREFILL_TOKENS,
                   help=f"most prompt tokens (batch × positions) per prefill forward; longer prefills run in "
                        f"chunks of positions (default {DEFAULT_MAX_PREFILL_TOKENS})")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up; medians reported")
    p.add_argument("--dtype", type=parsed_by(DType.parse), choices=names(DType), default=DType.FLOAT32,
                   help="precision of every cell and peer: weights, factors and KV caches (default float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="every raw sample and the summaries")
    p.add_argument("--markdown", type=Path, help="the tables as Markdown")
    p.add_argument("--plot", type=Path, help="PNG: decode tokens/s vs batch per TP, elements per token")
    p.add_argument("--roofline", action="store_true", help="measure copy/GEMM/collective rates; bound each step")
    p.add_argument("--peers", type=_names,
                   help="also time other implementations beside the cells: hf (transformers, factor pairs, "
                        "1 process × TP threads), deepspeed (AutoTP on the multiplied-out weights, TP ranks)")
    p.add_argument("--profile", action="store_true",
                   help="profile one decode step per rank: GEMM, waiting for the peer, collectives, the rest")
    p.add_argument("--predict", action="store_true",
                   help="the cost model's predicted step beside every cell's measured one (auto cells: always)")
    p.add_argument("--cell-timeout", type=float, default=1800.0, help="seconds before a cell is recorded as failed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(make_config=config_from_args, run=main)


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    if a.ratio is not None and a.model is not None:
        raise ValueError("--ratio applies to --synthetic; decompose the folder with "
                         "`deinfer-megatron decompose --ratio R` and bench the decomposed folder")
    peers: tuple[Peer, ...] = ()
    if a.peers is not None:
        peers = _members("--peers", a.peers, Peer.parse, [p.value for p in Peer])
        if not peers:
            raise ValueError(f"--peers needs at least one of {','.join(p.value for p in Peer)}")
    grid = BenchGrid(
        model=a.model, synthetic=a.synthetic, ratio=DEFAULT_RATIO if a.ratio is None else a.ratio,
        layouts=_layouts(a.layouts),
        kv_caches=_members("--kv-cache", a.kv_cache, CacheKind.parse, [k.value for k in CacheKind]),
        tps=a.tp, batches=a.batch, prompt_lens=a.prompt_len, gen_len=a.gen_len, repeats=a.repeats,
        seed=a.seed, max_prefill_tokens=a.max_prefill_tokens, roofline=a.roofline, profile=a.profile,
        predict=a.predict, cell_timeout_s=a.cell_timeout, peers=peers, dtype=a.dtype)
    outputs = BenchOutputs(json=a.json, markdown=a.markdown, plot=a.plot, progress=not a.no_progress)
    return BenchConfig(grid, outputs)


def _check_outputs(outputs: BenchOutputs) -> None:
    for flag, path in (("--json", outputs.json), ("--markdown", outputs.markdown), ("--plot", outputs.plot)):
        if path is not None and not path.resolve().parent.is_dir():
            raise ValueError(f"{flag} {path}: directory {path.resolve().parent} does not exist; create it first")


def _host(start_load: tuple[float, ...], started: str) -> dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "1")),
            "allocator": allocator.state(),  # this project's ranks; the peers run with glibc's defaults
            "load_avg_start": [round(x, 2) for x in start_load],
            "load_avg_end": [round(x, 2) for x in os.getloadavg()],
            "started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _source(grid: BenchGrid, workdir: Path) -> Any:
    if grid.synthetic is None:
        return folder_source(grid.model)
    for tp in grid.tps:  # before drawing a model that may take a while to write
        check_parallel_sizes(synthetic_arch(grid.synthetic), tp, 1)
    print(f"drawing {grid.synthetic} (ratio {grid.ratio:g}) into {workdir} ...", file=sys.stderr)
    return synthetic_source(grid.synthetic, grid.ratio, grid.seed, workdir)


def profiled_and_predicted(grid: BenchGrid, source: Any, records: list[Any]) -> list[Any]:
    """Measured cells with their ``--profile`` breakdown and the cost model's predicted step."""

    out = []
    for r in records:
        if r.status is CellStatus.OK:
            r = replace(r, step_profile=profile.cell_breakdown(r))
            if grid.predict or r.cell.layout.is_auto:
                r = replace(r, prediction=prediction.predict(r, source, collectives=grid.collectives,
                                                             dtype=grid.dtype.value))
        out.append(r)
    return out


def main(cfg: BenchConfig) -> int:
    grid, outputs = cfg.grid, cfg.outputs
    matrix.check_config(cfg)
    _check_outputs(outputs)
    start_load, started = os.getloadavg(), time.strftime("%Y-%m-%dT%H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="deinfer-bench-") as work:
        source = _source(grid, Path(work))
        matrix.check_sizes(grid, source)
        cells = matrix.prepare_cells(grid, source)  # one line when none can run
        machine = None
        if grid.roofline:
            print("measuring copy bandwidth, GEMM rate and collective latency ...", file=sys.stderr)
            machine = roofline.measure_machine(roofline.sizes_for(source.arch, grid.batches, grid.dtype.value))
        records = matrix.run_matrix(grid, cells, progress=outputs.progress)
        peers = peer_runs.run_peers(grid, source, progress=outputs.progress)
    records = [report.summarize(r) if r.status is CellStatus.OK else r for r in records]
    records = profiled_and_predicted(grid, source, records)
    if machine is not None:
        records = [replace(r, roofline=roofline.step_bound(r, source.arch, machine, grid.dtype.itemsize))
                   if r.status is CellStatus.OK else r for r in records]
    doc = report.document(cfg, source, records, machine, _host(start_load, started), peers)
    if outputs.json is not None:
        import json

        write_atomic(outputs.json, json.dumps(doc.to_json(), indent=1))
    if outputs.markdown is not None:
        write_atomic(outputs.markdown, report.markdown(doc))
    if outputs.plot is not None:

        write_atomic(outputs.plot, render_png(doc))
    print(report.text_table(doc.cells, doc.peers))
    for line in report.roofline_lines(doc.cells) + report.peer_ratio_lines(doc.peer_ratios):
        print(line)
    if doc.roofline and (table := roofline.transport_table(doc.roofline)):
        print(table, end="")
    failed = [r for r in doc.cells if r.status is CellStatus.ERROR]
    for r in failed:
        print(f"failed: {r.cell.label()}: {r.error}", file=sys.stderr)
    failed_peers = [p for p in doc.peers if p.status is CellStatus.ERROR]
    for p in failed_peers:
        print(f"failed: {p.label()}: {p.error}", file=sys.stderr)
    return 1 if failed or failed_peers else 0
