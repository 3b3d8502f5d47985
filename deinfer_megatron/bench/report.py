"""From per-rank measurements to summaries, speed-ups, and the JSON / Markdown / stdout reports.

Summaries take rank 0's timings (ranks meet in every collective, so their steps agree) and
every rank's memory. A figure is the median over the timed repeats; the warm-up run is kept in
the raw data but never summarised. Speed-ups compare the deinfer layout with the two baselines
(full KV cache) in the same (TP, batch, prompt length) cell: deinfer decode tokens/s ÷ the
baseline's, so above 1 means DeInfer is faster. Peers (``bench --peers``) are rows beside the
cells of their (TP, batch, prompt length), with every layout's tokens/s ÷ theirs. Files are
written atomically (temp + rename).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

from deinfer_megatron.bench import prediction, profile, roofline
from deinfer_megatron.bench.peers import ratios
from deinfer_megatron.bench.records import (CellRecord, CellStatus, Comparison, PeerRatio, PeerRecord, Speedups,
                                            Summary)
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.specs.layout import Layout

SCHEMA = "deinfer-megatron-bench/1"
BASELINES = (Layout.NAIVE, Layout.DENSE)  # what the deinfer layout is compared with (full KV cache)


def summarize(rec: CellRecord) -> CellRecord:
    """A measured cell with its ``summary``."""
    assert rec.status is CellStatus.OK and rec.plan is not None, "summarise a measured cell"
    ranks, plan = rec.ranks, rec.plan
    samples = ranks[0].samples
    med = lambda key: statistics.median(getattr(s, key) for s in samples)  # noqa: E731
    tpot = med("tpot_s")
    comm = [r.decode_step_comm for r in ranks]
    measured = (comm[0].collectives, comm[0].elements)
    summary = Summary(
        ttft_s=med("ttft_s"),
        prefill_s=med("prefill_s"),
        tpot_s=tpot,
        tpot_min_s=min(s.tpot_s for s in samples),
        tpot_max_s=max(s.tpot_s for s in samples),
        decode_tokens_per_s=rec.cell.batch / tpot,
        output_tokens_per_s=statistics.median(s.new_tokens / (s.ttft_s + s.decode_s) for s in samples),
        peak_rss_bytes=tuple(r.peak_rss_bytes for r in ranks),
        peak_rss_generate_bytes=tuple(r.peak_rss_generate_bytes for r in ranks),
        peak_rss_max_bytes=max(r.peak_rss_bytes for r in ranks),
        kv_cache_bytes=max(r.kv_cache_bytes for r in ranks),
        kv_cache_bytes_per_rank=tuple(r.kv_cache_bytes for r in ranks),
        kv_bytes_per_token=max(r.kv_bytes_per_token for r in ranks),
        collectives_per_token=measured[0],
        elements_per_token=measured[1],
        collectives_by_kind=dict(comm[0].by_kind),
        plan_collectives_per_token=plan.collectives_per_token,
        plan_elements_per_token=plan.elements_per_token,
        plan_match=all((c.collectives, c.elements) == measured for c in comm)
        and measured == (plan.collectives_per_token, plan.elements_per_token),
        load_s=max(r.load_s for r in ranks),
    )
    return replace(rec, summary=summary)


def compare(records: list[CellRecord]) -> tuple[list[CellRecord], list[Comparison]]:
    """DeInfer's decode speed-up over naive and dense, per (TP, batch, prompt length, KV cache):
    the records with the speed-ups in the deinfer cells' summaries, and the comparison rows."""
    ok = {(r.cell.layout.fixed, r.cell.kv_cache, r.cell.tp, r.cell.batch, r.cell.prompt_len): r
          for r in records if r.status is CellStatus.OK}  # auto cells (fixed None) are compared with nothing
    compared: dict[int, CellRecord] = {}
    rows = []
    for (layout, kv, tp, batch, ctx), rec in ok.items():
        if layout is not Layout.DEINFER:
            continue
        assert rec.summary is not None, "compare summarised cells"
        tps = rec.summary.decode_tokens_per_s
        ratio = {}
        for base in BASELINES:
            other = ok.get((base, CacheKind.FULL, tp, batch, ctx))
            ratio[base] = tps / other.summary.decode_tokens_per_s if other is not None else None
        speedups = Speedups(vs_naive=ratio[Layout.NAIVE], vs_dense=ratio[Layout.DENSE])
        compared[id(rec)] = replace(rec, summary=replace(rec.summary, speedups=speedups))
        rows.append(Comparison(tp, batch, ctx, kv, tps, speedups))
    return [compared.get(id(r), r) for r in records], rows


@dataclass(frozen=True)
class BenchDocument:
    """The whole report (``--json``, ``--markdown``, ``--plot``)."""

    host: dict[str, Any]
    args: dict[str, Any]  # the options, as given
    model: dict[str, Any]  # ModelSource.describe()
    cells: tuple[CellRecord, ...]
    comparisons: tuple[Comparison, ...]
    roofline: dict[str, Any] | None  # this machine's rates (roofline.measure_machine), when measured
    peers: tuple[PeerRecord, ...] = ()  # ``--peers``: written only when asked for
    peer_ratios: tuple[PeerRatio, ...] = ()

    def counts(self) -> dict[str, int]:
        return {s.value: sum(r.status is s for r in self.cells) for s in CellStatus}

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "host": self.host, "args": self.args, "model": self.model,
                "counts": self.counts(), "cells": [r.to_json() for r in self.cells],
                "comparisons": [c.to_json() for c in self.comparisons], "roofline": self.roofline,
                **({"peers": [p.to_json() for p in self.peers], "peer_ratios": [r.to_json() for r in self.peer_ratios]}
                   if self.peers else {})}


def document(cfg: Any, source: Any, records: list[CellRecord], machine: dict[str, Any] | None,
             host: dict[str, Any], peers: list[PeerRecord] | tuple[PeerRecord, ...] = ()) -> BenchDocument:
    """The report of a finished matrix (summarised records; speed-ups and peer ratios are computed here)."""

    cells, rows = compare(records)
    return BenchDocument(host, cfg.to_json(), source.describe(), tuple(cells), tuple(rows), machine,
                         tuple(peers), tuple(ratios(cells, peers)))


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


_COLUMNS = ("layout", "kv", "tp", "batch", "ctx", "TTFT ms", "TPOT ms", "decode tok/s", "out tok/s",
            "peak RSS MB", "KV MB", "coll/tok", "elem/tok", "plan", "vs naive", "vs dense", "bound ms")


def _row(rec: CellRecord) -> list[str]:
    c = rec.cell
    head = [c.layout_name, c.kv_cache.value, str(c.tp), str(c.batch), str(c.prompt_len)]
    if rec.status is not CellStatus.OK or rec.summary is None:
        note = rec.reason or rec.error or ""
        return head + [f"{rec.status.value}: {note}"]
    s, bound = rec.summary, rec.roofline
    speedups = s.speedups or Speedups(None, None)
    return head + [
        f"{s.ttft_s * 1e3:.1f}", f"{s.tpot_s * 1e3:.2f}", f"{s.decode_tokens_per_s:.1f}",
        f"{s.output_tokens_per_s:.1f}", _mb(s.peak_rss_max_bytes), _mb(s.kv_cache_bytes),
        str(s.collectives_per_token), str(s.elements_per_token), "ok" if s.plan_match else "DIFFERS",
        _x(speedups.vs_naive), _x(speedups.vs_dense), "-" if bound is None else f"{bound.bound_s * 1e3:.2f}"]


def _peer_row(rec: PeerRecord) -> list[str]:
    head = [f"{rec.peer} {rec.processes}x{rec.threads_per_process}", "-", str(rec.tp), str(rec.batch),
            str(rec.prompt_len)]
    s = rec.summary
    if rec.status is not CellStatus.OK or s is None:
        return head + [f"{rec.status.value}: {rec.reason or rec.error or ''}"]
    return head + [f"{s.ttft_s * 1e3:.1f}", f"{s.tpot_s * 1e3:.2f}", f"{s.decode_tokens_per_s:.1f}",
                   f"{s.output_tokens_per_s:.1f}", _mb(s.peak_rss_max_bytes)] + ["-"] * 7


def _rows(records: list[CellRecord] | tuple[CellRecord, ...], peers: tuple[PeerRecord, ...] = ()) -> list[list[str]]:
    """The cells' rows, each group's peers right after its last cell (the rest at the end)."""
    pending = list(peers)
    rows = []
    for i, rec in enumerate(records):
        rows.append(_row(rec))
        key = (rec.cell.tp, rec.cell.batch, rec.cell.prompt_len)
        nxt = records[i + 1].cell if i + 1 < len(records) else None
        if nxt is None or (nxt.tp, nxt.batch, nxt.prompt_len) != key:
            rows += [_peer_row(p) for p in pending if (p.tp, p.batch, p.prompt_len) == key]
            pending = [p for p in pending if (p.tp, p.batch, p.prompt_len) != key]
    return rows + [_peer_row(p) for p in pending]


def peer_ratio_lines(ratios: tuple[PeerRatio, ...] | list[PeerRatio]) -> list[str]:
    """One line per layout and group: its decode tokens/s ÷ each peer's."""
    lines: dict[tuple, list[str]] = {}
    for r in ratios:
        key = (r.layout, r.kv_cache.value, r.tp, r.batch, r.prompt_len)
        lines.setdefault(key, []).append(f"{r.ratio:.2f}x {r.peer}")
    return [f"{layout}/{kv} tp={tp} b={batch} ctx={ctx} decode tok/s vs peers: {', '.join(v)}"
            for (layout, kv, tp, batch, ctx), v in lines.items()]


def text_table(records: list[CellRecord] | tuple[CellRecord, ...], peers: tuple[PeerRecord, ...] = ()) -> str:
    """The compact table printed to stdout; a skipped or failed cell's reason runs past its row."""
    rows = [list(_COLUMNS)] + _rows(records, peers)
    widths = [max(len(r[i]) for r in rows if len(r) == len(_COLUMNS)) for i in range(len(_COLUMNS))]
    lines = []
    for r in rows:
        if len(r) == len(_COLUMNS):
            lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        else:
            lines.append("  ".join(c.rjust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
    return "\n".join(lines)


def roofline_lines(records: list[CellRecord] | tuple[CellRecord, ...]) -> list[str]:
    out = []
    for r in records:
        b = r.roofline
        if b is not None:
            out.append(f"{r.cell.label()}: "
                       f"bound {b.bound_s * 1e3:.2f} ms (memory {b.memory_s * 1e3:.2f} + "
                       f"{b.collectives} collectives {b.comm_s * 1e3:.2f}; compute {b.compute_s * 1e3:.2f}, "
                       f"with compute {b.bound_with_compute_s * 1e3:.2f}) "
                       f"vs measured {b.measured_s * 1e3:.2f} ms = {b.measured_over_bound:.2f}x")
    return out


def markdown(doc: BenchDocument) -> str:
    """The Markdown report (``--markdown``)."""
    m, host, args = doc.model, doc.host, doc.args
    dtype = args.get("dtype", "float32")  # written only when not float32 (earlier documents lack it)
    lines = [f"# deinfer-megatron bench: {m['name']}", "",
             f"{m['layers']} layers, hidden {m['hidden']}, {m['heads']}/{m['kv_heads']} heads, {dtype}; "
             f"{args['gen_len']} new tokens after one warm-up run, median of {args['repeats']} repeats. "
             f"Host: {host['cpus']} CPUs, load {host['load_avg_start']} at start, "
             f"{host['load_avg_end']} at end; torch {host['torch']}, {host['threads_per_rank']} thread(s) per rank.",
             "", "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for row in _rows(doc.cells, doc.peers):
        cells = row + [""] * (len(_COLUMNS) - len(row))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if doc.comparisons:
        lines += ["", "## DeInfer decode speed-up (deinfer tokens/s ÷ baseline tokens/s)", "",
                  "| tp | batch | ctx | kv | deinfer tok/s | vs naive | vs dense |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {c.tp} | {c.batch} | {c.prompt_len} | {c.kv_cache.value} | "
                  f"{c.deinfer_tokens_per_s:.1f} | {_x(c.speedups.vs_naive)} | {_x(c.speedups.vs_dense)} |"
                  for c in doc.comparisons]
    if doc.peer_ratios:
        lines += ["", "## Layouts against the peers (layout decode tokens/s ÷ peer decode tokens/s)", "",
                  "Peers: hf = Hugging Face transformers on the decomposed folder, factor pairs as nn.Linear, "
                  f"1 process × TP threads; deepspeed = DeepSpeed AutoTP (init_inference, tp_size TP, {dtype}) "
                  "on the multiplied-out weights, TP processes × 1 thread. Both: transformers' DynamicCache.", "",
                  "| layout | kv | tp | batch | ctx | peer | layout tok/s | peer tok/s | layout ÷ peer |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r.layout} | {r.kv_cache.value} | {r.tp} | {r.batch} | {r.prompt_len} | {r.peer} | "
                  f"{r.layout_tokens_per_s:.1f} | {r.peer_tokens_per_s:.1f} | {_x(r.ratio)} |" for r in doc.peer_ratios]
    machine = doc.roofline
    if machine:
        gemm = ", ".join(f"{g['m']}×{g['k']}×{g['n']}: {g['gflops']:.1f}" for g in machine["gemm"])
        lines += ["", "## Roofline", "", f"Copy bandwidth {machine['copy_gbps']:.2f} GB/s (read + write); "
                  f"GEMM GFLOP/s (1 thread) {gemm}.", ""]
        lines += [f"- {line}" for line in roofline_lines(doc.cells)]

        table = roofline.transport_table(machine)
        if table:
            lines += ["", f"Collective latency per element count ({dtype}, 2 ranks, µs per call, best of 3 rounds): "
                      f"the installed transport ({machine['comm_transport']}) against gloo.", "", table.rstrip("\n")]

    lines += prediction.markdown_lines(doc.cells) + profile.markdown_lines(doc.cells)
    return "\n".join(lines) + "\n"
