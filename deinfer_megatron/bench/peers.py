"""``bench --peers``: other implementations timed in the same run, on the same model, beside the cells.

A user choosing this project compares it with what they would otherwise run, so each peer runs
once per (TP, batch, prompt length) of the grid, on the cores that group's ranks use, with the
cells' prompts, lengths, repeats, warm-up and definitions (``peer_worker``):

- ``hf``: Hugging Face transformers on the decomposed folder, factor pairs as ``nn.Linear``s
  (``models.hf_factored``), one process with TP threads (one per core the TP ranks hold);
- ``deepspeed``: DeepSpeed AutoTP (``deepspeed.init_inference``, ``tp_size`` TP) on the
  multiplied-out dense weights, TP ranks of one thread, as the cells are started.

Both run in the cells' precision (``bench --dtype``: the model cast once at load, and
``init_inference(dtype=...)``), so that a ratio compares the same arithmetic.

A peer that cannot apply is recorded as skipped with the reason; one that fails gets its
one-line error and the rest go on, as cells do. The report divides every layout's decode
tokens/s by every peer's in the same group (above 1: the layout is faster).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

from deinfer_megatron.bench.matrix import BenchGrid, random_prompts
from deinfer_megatron.bench.peer_worker import PeerJob, deepspeed_worker, hf_worker
from deinfer_megatron.bench.records import (
    CellRecord,
    CellStatus,
    Peer,
    PeerMeasurement,
    PeerRatio,
    PeerRecord,
    PeerSummary,
    first_line,
)
from deinfer_megatron.bench.sources import ModelSource
from deinfer_megatron.launch.local import spawn_local


def shape(peer: Peer, tp: int) -> tuple[int, int]:
    """(processes, threads per process) of ``peer`` beside TP ``tp``: the same cores."""
    return (1, tp) if peer is Peer.HF else (tp, 1)


def skip_reason(peer: Peer, tp: int, source: ModelSource) -> str | None:
    """Why ``peer`` does not apply beside TP ``tp`` on this model; None when it does."""
    a = source.arch
    if peer is Peer.DEEPSPEED and (a.num_heads % tp or a.num_kv_heads % tp):
        return (f"DeepSpeed AutoTP shards attention by whole heads: TP {tp} does not divide "
                f"{a.num_heads} heads / {a.num_kv_heads} KV heads")
    return None


def _job(peer: Peer, tp: int, batch: int, prompt_len: int, source: ModelSource, grid: BenchGrid):
    _, threads = shape(peer, tp)
    folder = source.dense_dir if peer is Peer.DEEPSPEED else (source.decomposed_dir or source.dense_dir)
    cpus = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    return PeerJob(peer.value, folder, tp, threads, cpus, batch, prompt_len, grid.gen_len, grid.repeats,
                   random_prompts(source.arch.vocab_size, batch, prompt_len, grid.seed), grid.dtype)


def run_peer(peer: Peer, tp: int, batch: int, prompt_len: int, source: ModelSource,
             grid: BenchGrid) -> list[PeerMeasurement]:
    """Run ``peer`` in fresh processes; every process's measurements, by rank."""

    processes, _ = shape(peer, tp)
    worker = hf_worker if peer is Peer.HF else deepspeed_worker
    job = _job(peer, tp, batch, prompt_len, source, grid)
    return spawn_local(processes, worker, job, timeout=grid.cell_timeout_s)


PeerRunner = Callable[[Peer, int, int, int, ModelSource, BenchGrid], list[PeerMeasurement]]


def run_peers(grid: BenchGrid, source: ModelSource, runner: PeerRunner = run_peer, *,
              progress: bool = True) -> list[PeerRecord]:
    """Every peer of ``grid.peers`` beside every (TP, batch, prompt length), in the cells' order."""
    from tqdm import tqdm

    groups = [(peer, tp, batch, ctx) for ctx in grid.prompt_lens for tp in grid.tps for batch in grid.batches
              for peer in grid.peers]
    records = []
    bar = tqdm(groups, desc="peers", unit="run", disable=not progress or not groups, dynamic_ncols=True)
    for peer, tp, batch, ctx in bar:
        processes, threads = shape(peer, tp)
        head = dict(peer=peer.value, tp=tp, batch=batch, prompt_len=ctx, gen_len=grid.gen_len, repeats=grid.repeats,
                    processes=processes, threads_per_process=threads)
        bar.set_postfix_str(f"{peer.value} tp={tp} b={batch} ctx={ctx}")
        reason = skip_reason(peer, tp, source)
        if reason is not None:
            records.append(PeerRecord(**head, status=CellStatus.SKIPPED, reason=reason))
            continue
        start = time.perf_counter()
        try:
            ranks = runner(peer, tp, batch, ctx, source, grid)
        except Exception as err:  # noqa: BLE001 - a failed peer is data; the run goes on
            records.append(PeerRecord(**head, status=CellStatus.ERROR, error=first_line(err),
                                      wall_s=time.perf_counter() - start))
            continue
        records.append(summarize(PeerRecord(**head, status=CellStatus.OK, wall_s=time.perf_counter() - start,
                                            ranks=tuple(ranks))))
    bar.close()
    return records


def summarize(rec: PeerRecord) -> PeerRecord:
    """A measured peer with its summary (process 0's medians, every process's memory)."""
    from dataclasses import replace

    samples = rec.ranks[0].samples
    med = lambda key: statistics.median(getattr(s, key) for s in samples)  # noqa: E731
    tpot = med("tpot_s")
    summary = PeerSummary(
        ttft_s=med("ttft_s"), prefill_s=med("prefill_s"), tpot_s=tpot,
        tpot_min_s=min(s.tpot_s for s in samples), tpot_max_s=max(s.tpot_s for s in samples),
        decode_tokens_per_s=rec.batch / tpot,
        output_tokens_per_s=statistics.median(s.new_tokens / (s.ttft_s + s.decode_s) for s in samples),
        peak_rss_bytes=tuple(r.peak_rss_bytes for r in rec.ranks),
        peak_rss_max_bytes=max(r.peak_rss_bytes for r in rec.ranks),
        load_s=max(r.load_s for r in rec.ranks))
    return replace(rec, summary=summary)


def ratios(cells: list[CellRecord] | tuple[CellRecord, ...],
           peers: list[PeerRecord] | tuple[PeerRecord, ...]) -> list[PeerRatio]:
    """Every measured layout's decode tokens/s ÷ every measured peer's in the same group."""
    out = []
    for cell in cells:
        if cell.status is not CellStatus.OK or cell.summary is None:
            continue
        c = cell.cell
        for p in peers:
            if p.summary is not None and (p.tp, p.batch, p.prompt_len) == (c.tp, c.batch, c.prompt_len):
                out.append(PeerRatio(c.layout_name, c.kv_cache, p.peer, c.tp, c.batch, c.prompt_len,
                                     cell.summary.decode_tokens_per_s, p.summary.decode_tokens_per_s))
    return out
