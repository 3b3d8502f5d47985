"""Plain-text tables of one or more plans (layouts side by side)."""

from __future__ import annotations

from deinfer_megatron.planning.plan import LayerPlan, Plan
from deinfer_megatron.specs.layout import Layout

_SHORT = {"all_gather": "AG", "all_reduce": "AR", "reduce_scatter": "RS"}


def human(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def _ranks(layer: LayerPlan) -> str:
    r = layer.ranks
    if not r:
        return "-"
    attn = "/".join(str(r[k]) for k in ("q", "k", "v", "o") if k in r)
    mlp = "/".join(str(r[k]) for k in ("gate", "up", "down", "fc1", "fc2") if k in r)
    return " ".join(x for x in (attn and f"qkvo={attn}", mlp and f"mlp={mlp}") if x)


def _ops(layer: LayerPlan) -> str:
    return "+".join(f"{_SHORT[k]}{e}" for k, e in layer.collective_ops) or "-"


def _kv(layer: LayerPlan) -> str:
    kv = layer.kv_bytes_per_token
    return f"{kv['full']}/{kv['latent']}" if kv["latent"] is not None else f"{kv['full']}/-"


def _per_block(plan: Plan) -> bool:
    """A plan with a layout per block (``auto``): its rows show each block's choice."""
    return plan.layout not in {layout.value for layout in Layout}


def format_plans(plans: list[Plan]) -> str:
    """One row per layer; per layout: collectives, elements/token (forward; and of a training
    step, forward + backward), params/rank, KV bytes."""
    first = plans[0]
    lines = [
        f"TP={first.tp} PP={first.pp} batch={first.batch} seq={first.seq} "
        f"dtype_bytes={first.dtype_bytes}   (per token, per rank; KV = full/latent bytes)",
    ]
    head = f"{'layer':>5} {'kind':<20} {'ranks':<28}"
    for p in plans:
        if _per_block(p):
            head += f" | {'attn/mlp layout':<15}"
        head += f" | {p.layout + ' collectives':<28} {'elem':>6} {'train':>6} {'params':>7} {'KV B':>9}"
    lines += [head, "-" * len(head)]
    for i, layer in enumerate(first.layers):
        row = f"{layer.index:>5} {layer.kind:<20} {_ranks(layer):<28}"
        for p in plans:
            lp = p.layers[i]
            if _per_block(p):
                row += f" | {lp.layouts['attention'] + '/' + lp.layouts['mlp']:<15}"
            row += (f" | {_ops(lp):<28} {lp.elements_per_token:>6} {lp.training_elements_per_token:>6} "
                    f"{human(lp.params_per_rank):>7} {_kv(lp):>9}")
        lines.append(row)
    lines.append("-" * len(head))
    for p in plans:
        t = p.totals
        kv = t["kv_bytes_per_token"]
        lines.append(
            f"{p.layout:>8}: {t['collectives_per_token']} collectives and "
            f"{human(t['elements_per_token'])} elements per token, "
            f"{human(t['params_per_rank'])} params per rank, KV cache {human(kv['full'])} B/token full, "
            f"{human(kv['latent'])} B/token latent; per forward of {p.batch}x{p.seq} tokens: "
            f"{human(t['elements_per_forward'])} elements, KV {human(t['kv_bytes_for_batch']['full'])} B full; "
            f"a training step (forward + backward): {t['training_collectives_per_token']} collectives and "
            f"{human(t['training_elements_per_token'])} elements per token"
        )
        predicted = t.get("predicted_decode_step_s")
        if predicted:
            fixed = ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in predicted.items() if k != p.layout)
            lines.append(f"{p.layout:>8}: predicted decode step {1e3 * predicted[p.layout]:.3f} ms "
                         f"(the transformer layers, batch {p.batch}, context {p.seq}; fixed layouts: {fixed})")
    return "\n".join(lines)
