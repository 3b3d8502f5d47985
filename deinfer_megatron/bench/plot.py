"""The bench's PNG (``--plot``): decode tokens/s against batch, one panel per TP, one line per
layout (and KV cache, and prompt length when there are several); then one panel of elements
communicated per token, per layout and TP. matplotlib's Agg backend: no display needed."""

from __future__ import annotations

import io

from deinfer_megatron.bench.records import CellRecord, CellStatus
from deinfer_megatron.bench.report import BenchDocument
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.planning.request import LayoutRequest, choices

# One colour and marker per --layout choice, in the order of ``choices()`` (auto first): a new
# layout takes the next pair.
_PALETTE = (("tab:green", "D"), ("tab:blue", "o"), ("tab:red", "v"), ("tab:gray", "s"),
            ("tab:purple", "^"), ("tab:orange", "P"), ("tab:brown", "X"))
STYLE = {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(choices())}

Series = dict[tuple[LayoutRequest, CacheKind, int], list[tuple[int, float]]]  # (layout, kv, ctx) → (batch, tok/s)


def _measured(records: tuple[CellRecord, ...]) -> list[CellRecord]:
    return [r for r in records if r.status is CellStatus.OK and r.summary is not None]


def _series(records: tuple[CellRecord, ...], tp: int) -> Series:
    lines: Series = {}
    for r in _measured(records):
        if r.cell.tp == tp:
            key = (r.cell.layout, r.cell.kv_cache, r.cell.prompt_len)
            lines.setdefault(key, []).append((r.cell.batch, r.summary.decode_tokens_per_s))
    return {k: sorted(v) for k, v in lines.items()}


def _label(layout: LayoutRequest, kv: CacheKind, ctx: int, several_ctx: bool) -> str:
    label = layout.name + ("" if kv is CacheKind.FULL else f" ({kv.value} KV)")
    return label + (f" ctx={ctx}" if several_ctx else "")


def render_png(doc: BenchDocument) -> bytes:
    """The figure as PNG bytes (the caller writes them atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = doc.cells
    tps = sorted({r.cell.tp for r in records})
    several_ctx = len({r.cell.prompt_len for r in records}) > 1
    fig, axes = plt.subplots(1, len(tps) + 1, figsize=(4.5 * (len(tps) + 1), 4), squeeze=False)
    for ax, tp in zip(axes[0], tps):
        for (layout, kv, ctx), points in _series(records, tp).items():
            color, marker = STYLE[layout.name]
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=marker, color=color, label=_label(layout, kv, ctx, several_ctx),
                    linestyle="--" if kv is CacheKind.LATENT else "-")
        ax.set_xscale("log", base=2)
        batches = sorted({r.cell.batch for r in records})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_title(f"TP={tp}")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[0][-1]
    layouts = [l for l in dict.fromkeys(r.cell.layout for r in records) if not l.is_auto]  # fixed: one plan per TP
    width = 0.8 / max(1, len(layouts))
    for i, layout in enumerate(layouts):
        elems = []
        for tp in tps:
            vals = [r.summary.elements_per_token for r in _measured(records)
                    if r.cell.layout == layout and r.cell.tp == tp]
            elems.append(vals[0] if vals else 0)
        ax.bar([j + i * width for j in range(len(tps))], elems, width, label=layout.name, color=STYLE[layout.name][0])
    ax.set_xticks([j + width * (len(layouts) - 1) / 2 for j in range(len(tps))], [f"TP={t}" for t in tps])
    ax.set_ylabel("elements communicated per token")
    ax.set_title("communication per token")
    ax.legend(fontsize=8)
    fig.suptitle(f"deinfer-megatron bench: {doc.model['name']}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
