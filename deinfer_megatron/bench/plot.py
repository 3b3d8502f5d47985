"""The bench's PNG (``--plot``): decode tokens/s against batch, one panel per TP, one line per
layout (and KV cache, and prompt length when there are several); then one panel of elements
communicated per token, per layout and TP. matplotlib's Agg backend: no display needed."""

from __future__ import annotations

import io
from typing import Any

STYLE = {"dense": ("tab:gray", "s"), "naive": ("tab:red", "v"), "deinfer": ("tab:blue", "o")}


def _series(records: list[dict[str, Any]], tp: int, several_ctx: bool) -> dict[str, list[tuple[int, float]]]:
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r["status"] != "ok" or r["tp"] != tp:
            continue
        label = r["layout"] + ("" if r["kv_cache"] == "full" else f" ({r['kv_cache']} KV)")
        label += f" ctx={r['prompt_len']}" if several_ctx else ""
        lines.setdefault(label, []).append((r["batch"], r["summary"]["decode_tokens_per_s"]))
    return {k: sorted(v) for k, v in lines.items()}


def render_png(doc: dict[str, Any]) -> bytes:
    """The figure as PNG bytes (the caller writes them atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = doc["cells"]
    tps = sorted({r["tp"] for r in records})
    several_ctx = len({r["prompt_len"] for r in records}) > 1
    fig, axes = plt.subplots(1, len(tps) + 1, figsize=(4.5 * (len(tps) + 1), 4), squeeze=False)
    for ax, tp in zip(axes[0], tps):
        for label, points in _series(records, tp, several_ctx).items():
            color, marker = STYLE.get(label.split()[0], ("black", "x"))
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=marker, color=color, label=label,
                    linestyle="--" if "latent" in label else "-")
        ax.set_xscale("log", base=2)
        batches = sorted({r["batch"] for r in records})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_title(f"TP={tp}")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[0][-1]
    layouts = [l for l in ("dense", "naive", "deinfer") if any(r["layout"] == l for r in records)]
    width = 0.8 / max(1, len(layouts))
    for i, layout in enumerate(layouts):
        elems = []
        for tp in tps:
            vals = [r["summary"]["elements_per_token"] for r in records
                    if r["status"] == "ok" and r["layout"] == layout and r["tp"] == tp]
            elems.append(vals[0] if vals else 0)
        ax.bar([j + i * width for j in range(len(tps))], elems, width, label=layout, color=STYLE[layout][0])
    ax.set_xticks([j + width * (len(layouts) - 1) / 2 for j in range(len(tps))], [f"TP={t}" for t in tps])
    ax.set_ylabel("elements communicated per token")
    ax.set_title("communication per token")
    ax.legend(fontsize=8)
    fig.suptitle(f"deinfer-megatron bench: {doc['model']['name']}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
