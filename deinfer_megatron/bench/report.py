"""From per-rank measurements to summaries, speed-ups, and the JSON / Markdown / stdout reports.

Summaries take rank 0's timings (ranks meet in every collective, so their steps agree) and
every rank's memory. A figure is the median over the timed repeats; the warm-up run is kept in
the raw data but never summarised. Speed-ups compare the deinfer layout with the two baselines
(full KV cache) in the same (TP, batch, prompt length) cell: deinfer decode tokens/s ÷ the
baseline's, so above 1 means DeInfer is faster. Files are written atomically (temp + rename).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

SCHEMA = "deinfer-megatron-bench/1"


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    """The summary of an "ok" cell record (also stored in it as ``rec["summary"]``)."""
    ranks = rec["ranks"]
    samples = ranks[0]["samples"]
    med = lambda key: statistics.median(s[key] for s in samples)  # noqa: E731
    tpot = med("tpot_s")
    comm = [r["decode_step_comm"] for r in ranks]
    plan = rec["plan"]
    measured = (comm[0]["collectives"], comm[0]["elements"])
    rec["summary"] = {
        "ttft_s": med("ttft_s"),
        "prefill_s": med("prefill_s"),
        "tpot_s": tpot,
        "tpot_min_s": min(s["tpot_s"] for s in samples),
        "tpot_max_s": max(s["tpot_s"] for s in samples),
        "decode_tokens_per_s": rec["batch"] / tpot,
        "output_tokens_per_s": statistics.median(s["new_tokens"] / (s["ttft_s"] + s["decode_s"]) for s in samples),
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
        "peak_rss_generate_bytes": [r["peak_rss_generate_bytes"] for r in ranks],
        "peak_rss_max_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "kv_cache_bytes": max(r["kv_cache_bytes"] for r in ranks),
        "kv_cache_bytes_per_rank": [r["kv_cache_bytes"] for r in ranks],
        "kv_bytes_per_token": max(r["kv_bytes_per_token"] for r in ranks),
        "collectives_per_token": measured[0],
        "elements_per_token": measured[1],
        "collectives_by_kind": comm[0]["by_kind"],
        "plan_collectives_per_token": plan["collectives_per_token"],
        "plan_elements_per_token": plan["elements_per_token"],
        "plan_match": all((c["collectives"], c["elements"]) == measured for c in comm)
        and measured == (plan["collectives_per_token"], plan["elements_per_token"]),
        "load_s": max(r["load_s"] for r in ranks),
    }
    return rec["summary"]


def comparisons(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DeInfer's decode speed-up over naive and dense, per (TP, batch, prompt length, KV cache)."""
    ok = {(r["layout"], r["kv_cache"], r["tp"], r["batch"], r["prompt_len"]): r
          for r in records if r["status"] == "ok"}
    out = []
    for (layout, kv, tp, batch, ctx), rec in ok.items():
        if layout != "deinfer":
            continue
        tps = rec["summary"]["decode_tokens_per_s"]
        row = {"tp": tp, "batch": batch, "prompt_len": ctx, "kv_cache": kv, "deinfer_tokens_per_s": tps}
        for base in ("naive", "dense"):
            other = ok.get((base, "full", tp, batch, ctx))
            speedup = tps / other["summary"]["decode_tokens_per_s"] if other else None
            row[f"speedup_vs_{base}"] = speedup
            rec["summary"][f"speedup_vs_{base}"] = speedup
        out.append(row)
    return out


def document(cfg: Any, source: Any, records: list[dict[str, Any]], machine: dict[str, Any] | None,
             host: dict[str, Any]) -> dict[str, Any]:
    """The whole JSON document (``--json``)."""
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()}
    counts = {s: sum(r["status"] == s for r in records) for s in ("ok", "skipped", "error")}
    return {"schema": SCHEMA, "host": host, "args": args, "model": source.describe(), "counts": counts,
            "cells": records, "comparisons": comparisons(records), "roofline": machine}


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``path`` through a temporary sibling and a rename: readers never see half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent or Path("."), prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


_COLUMNS = ("layout", "kv", "tp", "batch", "ctx", "TTFT ms", "TPOT ms", "decode tok/s", "out tok/s",
            "peak RSS MB", "KV MB", "coll/tok", "elem/tok", "plan", "vs naive", "vs dense", "bound ms")


def _row(rec: dict[str, Any]) -> list[str]:
    head = [rec["layout"], rec["kv_cache"], str(rec["tp"]), str(rec["batch"]), str(rec["prompt_len"])]
    if rec["status"] != "ok":
        note = rec.get("reason") or rec.get("error", "")
        return head + [f"{rec['status']}: {note}"]
    s = rec["summary"]
    bound = rec.get("roofline")
    return head + [
        f"{s['ttft_s'] * 1e3:.1f}", f"{s['tpot_s'] * 1e3:.2f}", f"{s['decode_tokens_per_s']:.1f}",
        f"{s['output_tokens_per_s']:.1f}", _mb(s["peak_rss_max_bytes"]), _mb(s["kv_cache_bytes"]),
        str(s["collectives_per_token"]), str(s["elements_per_token"]), "ok" if s["plan_match"] else "DIFFERS",
        _x(s.get("speedup_vs_naive")), _x(s.get("speedup_vs_dense")),
        "-" if bound is None else f"{bound['bound_s'] * 1e3:.2f}"]


def text_table(records: list[dict[str, Any]]) -> str:
    """The compact table printed to stdout; a skipped or failed cell's reason runs past its row."""
    rows = [list(_COLUMNS)] + [_row(r) for r in records]
    widths = [max(len(r[i]) for r in rows if len(r) == len(_COLUMNS)) for i in range(len(_COLUMNS))]
    lines = []
    for r in rows:
        if len(r) == len(_COLUMNS):
            lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        else:
            lines.append("  ".join(c.rjust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
    return "\n".join(lines)


def roofline_lines(records: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in records:
        b = r.get("roofline")
        if b:
            out.append(f"{r['layout']}/{r['kv_cache']} tp={r['tp']} b={r['batch']} ctx={r['prompt_len']}: "
                       f"bound {b['bound_s'] * 1e3:.2f} ms (memory {b['memory_s'] * 1e3:.2f} + "
                       f"{b['collectives']} collectives {b['comm_s'] * 1e3:.2f}; compute {b['compute_s'] * 1e3:.2f}, "
                       f"with compute {b['bound_with_compute_s'] * 1e3:.2f}) "
                       f"vs measured {b['measured_s'] * 1e3:.2f} ms = {b['measured_over_bound']:.2f}x")
    return out


def markdown(doc: dict[str, Any]) -> str:
    """The Markdown report (``--markdown``)."""
    m, host, args = doc["model"], doc["host"], doc["args"]
    lines = [f"# deinfer-megatron bench: {m['name']}", "",
             f"{m['layers']} layers, hidden {m['hidden']}, {m['heads']}/{m['kv_heads']} heads; "
             f"{args['gen_len']} new tokens after one warm-up run, median of {args['repeats']} repeats. "
             f"Host: {host['cpus']} CPUs, load {host['load_avg_start']} at start, "
             f"{host['load_avg_end']} at end; torch {host['torch']}, {host['threads_per_rank']} thread(s) per rank.",
             "", "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for r in doc["cells"]:
        cells = _row(r) + [""] * (len(_COLUMNS) - len(_row(r)))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if doc["comparisons"]:
        lines += ["", "## DeInfer decode speed-up (deinfer tokens/s ÷ baseline tokens/s)", "",
                  "| tp | batch | ctx | kv | deinfer tok/s | vs naive | vs dense |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {c['tp']} | {c['batch']} | {c['prompt_len']} | {c['kv_cache']} | "
                  f"{c['deinfer_tokens_per_s']:.1f} | {_x(c['speedup_vs_naive'])} | {_x(c['speedup_vs_dense'])} |"
                  for c in doc["comparisons"]]
    machine = doc["roofline"]
    if machine:
        gemm = ", ".join(f"{g['m']}×{g['k']}×{g['n']}: {g['gflops']:.1f}" for g in machine["gemm"])
        lines += ["", "## Roofline", "", f"Copy bandwidth {machine['copy_gbps']:.2f} GB/s (read + write); "
                  f"GEMM GFLOP/s (1 thread) {gemm}.", ""]
        lines += [f"- {line}" for line in roofline_lines(doc["cells"])]
    return "\n".join(lines) + "\n"
