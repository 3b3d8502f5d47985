"""``loadgen``'s sides side by side: the server, the project's static batches and every peer
(``load_peers``), each as one row of the same figures, and the server's ratio to each other side.

A row: completion tokens, wall time and throughput (tokens over the wall time from the first
arrival to the last answer), the CPU seconds the side was given (the server: its model-loop and
HTTP threads on rank 0, from ``/metrics``; the static batches: rank 0's thread over the batches; a
peer: its whole process over the batches) and the tokens per CPU second, TTFT, TPOT and end-to-end
p50 / p99, and peak resident memory (the server: rank 0's process; the static batches: rank 0's;
a peer: its process; loading included). On a machine shared with other work the sides, run one
after the other, meet different loads; tokens per CPU second does not depend on that, so each
ratio is given both ways.
"""

from __future__ import annotations

from typing import Any

COLUMNS = ("side", "tokens/s", "tokens/CPU s", "CPU s", "TTFT p50/p99 s", "TPOT p50/p99 s", "e2e p50/p99 s",
           "peak RSS MB")


def side_row(side: dict[str, Any]) -> dict[str, Any]:
    """One side's figures (a server's report reads its CPU seconds and memory from ``metrics``)."""
    metrics = side.get("metrics", {})
    if "cpu_s" in side:
        cpu = side["cpu_s"]
    else:
        threads = metrics.get("thread_cpu_s", {})
        cpu = sum(v or 0.0 for v in threads.values()) if threads else None
    tokens = side["completion_tokens"]
    return {"completion_tokens": tokens, "wall_s": side["wall_s"],
            "throughput_tokens_per_s": side["throughput_tokens_per_s"], "cpu_s": cpu,
            "tokens_per_cpu_s": tokens / cpu if cpu else None,
            "ttft_s": side["ttft_s"], "tpot_s": side.get("tpot_s"), "e2e_s": side["e2e_s"],
            "peak_rss_bytes": side.get("peak_rss_bytes", metrics.get("peak_rss_bytes"))}


def compare(report: dict[str, Any]) -> dict[str, Any]:
    """Every side's row, by name (``server``, ``static``, then each peer), and the server's
    throughput ÷ each other side's, over the wall time and per CPU second."""
    sides = {name: report[name] for name in ("server", "static") if name in report}
    sides.update((name, peer) for name, peer in report.get("peers", {}).items() if "error" not in peer)
    rows = {name: side_row(side) for name, side in sides.items()}
    ratios = {}
    if "server" in rows:
        server = rows["server"]
        for name, row in rows.items():
            if name == "server":
                continue
            per_cpu = (server["tokens_per_cpu_s"] / row["tokens_per_cpu_s"]
                       if server["tokens_per_cpu_s"] and row["tokens_per_cpu_s"] else None)
            ratios[name] = {"throughput": server["throughput_tokens_per_s"] / max(1e-9, row["throughput_tokens_per_s"]),
                            "per_cpu_s": per_cpu}
    return {"sides": rows, "server_over": ratios}


def _pair(stats: dict[str, Any] | None) -> str:
    if not stats or stats.get("p50") is None:
        return "—"
    return f"{stats['p50']:.3f} / {stats['p99']:.3f}"


def text_table(comparison: dict[str, Any]) -> list[str]:
    """The rows as aligned text lines, then the server's ratios."""
    table = [COLUMNS]
    for name, r in comparison["sides"].items():
        table.append((name, f"{r['throughput_tokens_per_s']:.1f}",
                      "—" if r["tokens_per_cpu_s"] is None else f"{r['tokens_per_cpu_s']:.1f}",
                      "—" if r["cpu_s"] is None else f"{r['cpu_s']:.1f}",
                      _pair(r["ttft_s"]), _pair(r["tpot_s"]), _pair(r["e2e_s"]),
                      "—" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / 2**20:.0f}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    for name, ratio in comparison["server_over"].items():
        per_cpu = "" if ratio["per_cpu_s"] is None else f", {ratio['per_cpu_s']:.2f}× per CPU second"
        lines.append(f"server / {name}: {ratio['throughput']:.2f}× throughput{per_cpu}")
    return lines
