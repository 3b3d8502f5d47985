"""What a model costs per rank in a given layout, computed from its config and rank config.

For every transformer layer: whether it is dense or decomposed, its ranks, the parameters one
rank holds, the collectives it issues per token (kind and element count, the unit of
DESIGN.md §3) and the KV-cache bytes per token one rank stores (full K/V, and rank-r latents).
The numbers are formulas over the same partition rules the layers use; the test suite checks
them against an instrumented forward pass and the parameters a built model really allocates.
Collectives of the embedding and the output layer (Megatron's own) are not included.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.parallel.topology import TPView, balanced_split, padded_chunk, unit_split
from deinfer_megatron.specs.builder import require_dense_attention_fits
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import LayerRanks, RankConfig


@dataclass
class LayerPlan:
    index: int
    kind: str  # "dense" | "decomposed" | "attention-decomposed" | "mlp-decomposed"
    ranks: dict[str, int]
    params_per_rank: int
    collectives: int
    collective_ops: list[tuple[str, int]]  # (kind, elements per token)
    elements_per_token: int
    kv_bytes_per_token: dict[str, int | None]  # {"full": ..., "latent": ... or None}


@dataclass
class Plan:
    layout: str
    tp: int
    pp: int
    batch: int
    seq: int
    dtype_bytes: int
    layers: list[LayerPlan]
    stages: list[tuple[int, int]]  # [first, last) layer of each pipeline stage
    totals: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for layer in out["layers"]:
            layer["collective_ops"] = [{"kind": k, "elements": e} for k, e in layer["collective_ops"]]
        return out


# ------------------------------------------------------------------------- per-block formulas


def _attention(arch: ModelArch, ranks: Any, layout: Layout, tp: TPView) -> tuple[int, list, int]:
    """(params on rank ``tp.rank``, collectives, KV heads stored) of one attention block."""
    h, d = arch.hidden_size, arch.head_dim
    q_span = unit_split(arch.num_heads, d, tp)
    kv_span = unit_split(arch.num_kv_heads, d, tp)
    qkv_bias = arch.qkv_bias
    o_bias = h if arch.linear_bias else 0
    if ranks is None or layout is Layout.DENSE:  # Megatron's SelfAttention
        rows = q_span.size + 2 * kv_span.size
        params = rows * h + (rows if qkv_bias else 0) + h * q_span.size + o_bias
        return params, [("all_reduce", h)] if tp.size > 1 else [], kv_span.size // d
    r_qkv = (ranks.q, ranks.k, ranks.v)
    if layout is Layout.DEINFER:
        params = padded_chunk(sum(r_qkv), tp.size) * h
        for span, r in ((q_span, ranks.q), (kv_span, ranks.k), (kv_span, ranks.v)):
            params += span.size * r + (span.size if qkv_bias else 0)
        params += ranks.o * q_span.size + h * ranks.o + o_bias
        ops = [("all_gather", tp.size * padded_chunk(sum(r_qkv), tp.size)), ("all_reduce", ranks.o)]
        return params, ops if tp.size > 1 else [], kv_span.size // d
    # naive: every rank holds all heads
    local = [balanced_split(r, tp).size for r in r_qkv]
    q_full, kv_full = arch.num_heads * d, arch.num_kv_heads * d
    params = sum(local) * h
    for full, r in ((q_full, local[0]), (kv_full, local[1]), (kv_full, local[2])):
        params += full * r + (full if qkv_bias else 0)
    r_o = balanced_split(ranks.o, tp).size
    params += r_o * q_full + h * r_o + o_bias
    ops = [("all_reduce", q_full), ("all_reduce", kv_full), ("all_reduce", kv_full), ("all_reduce", h)]
    return params, ops if tp.size > 1 else [], arch.num_kv_heads


def _mlp(arch: ModelArch, ranks: Any, layout: Layout, tp: TPView) -> tuple[int, list]:
    h, i = arch.hidden_size, arch.ffn_hidden_size
    sections = 2 if arch.gated else 1
    bias = arch.linear_bias
    i_span = balanced_split(i, tp)
    if ranks is None or layout is Layout.DENSE:  # Megatron's MLP
        rows = sections * i_span.size
        params = rows * h + (rows if bias else 0) + h * i_span.size + (h if bias else 0)
        return params, [("all_reduce", h)] if tp.size > 1 else []
    ups = ranks.up_sections
    if layout is Layout.DEINFER:
        params = padded_chunk(sum(ups), tp.size) * h
        params += sections * i_span.size * max(ups) + (sections * i_span.size if bias else 0)
        params += ranks.down * i_span.size + h * ranks.down + (h if bias else 0)
        ops = [("all_gather", tp.size * padded_chunk(sum(ups), tp.size)), ("all_reduce", ranks.down)]
        return params, ops if tp.size > 1 else []
    local = [balanced_split(r, tp).size for r in ups]
    params = sum(local) * h + sections * i * max(local) + (sections * i if bias else 0)
    r_d = balanced_split(ranks.down, tp).size
    params += r_d * i + h * r_d + (h if bias else 0)
    ops = [("all_reduce", i)] * sections + [("all_reduce", h)]
    return params, ops if tp.size > 1 else []


def _norm_params(arch: ModelArch) -> int:
    return 2 * arch.hidden_size * (2 if arch.family == "opt" else 1)


def _rank_names(arch: ModelArch, rank_config: RankConfig, index: int) -> dict[str, int]:
    names = {**arch.attention_modules(index), **arch.mlp_modules(index)}
    return {role: rank_config.modules[n] for role, n in names.items() if n in rank_config.modules}


def layer_plan(
    arch: ModelArch, rank_config: RankConfig, layout: Layout, tp: int, index: int, dtype_bytes: int
) -> LayerPlan:
    """The plan of global layer ``index``; parameters are the maximum over the TP ranks."""
    ranks: LayerRanks = rank_config.layers[index]
    dense = layout is Layout.DENSE
    attn = None if dense else ranks.attention
    mlp = None if dense else ranks.mlp
    if attn is None:
        require_dense_attention_fits(arch.num_kv_heads, tp, index)
    params, kv_heads = 0, 0
    ops: list[tuple[str, int]] = []
    for rank in range(tp):
        view = TPView(rank, tp)
        p_a, ops_a, kv_heads = _attention(arch, attn, layout, view)
        p_m, ops_m = _mlp(arch, mlp, layout, view)
        params = max(params, p_a + p_m + _norm_params(arch))
        ops = ops_a + ops_m
    full = 2 * kv_heads * arch.head_dim * dtype_bytes
    latent = None if attn is None else (attn.k + attn.v) * dtype_bytes
    # kind and ranks describe the model; the dense layout serves the same factors multiplied out
    kind = {(True, True): "decomposed", (True, False): "attention-decomposed",
            (False, True): "mlp-decomposed", (False, False): "dense"}[
        (ranks.attention is not None, ranks.mlp is not None)]
    return LayerPlan(
        index=index,
        kind=kind,
        ranks=_rank_names(arch, rank_config, index),
        params_per_rank=params,
        collectives=len(ops),
        collective_ops=ops,
        elements_per_token=sum(e for _, e in ops),
        kv_bytes_per_token={"full": full, "latent": latent},
    )


def _stage_bounds(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Megatron's even split of layers over stages (the remainder is not supported there)."""
    if num_layers % pp:
        raise ValueError(f"{num_layers} layers do not split evenly over --pp {pp}")
    per = num_layers // pp
    return [(s * per, (s + 1) * per) for s in range(pp)]


def _edge_params(arch: ModelArch, tp: int, pp: int, stage: int) -> int:
    """Embedding (first stage), final norm and output layer (last stage), per rank."""
    h = arch.hidden_size
    vocab_rows = -(-arch.vocab_size // tp)
    params = 0
    if stage == 0:
        params += vocab_rows * h + (arch.max_positions * h if arch.family == "opt" else 0)
    if stage == pp - 1:
        params += h * (2 if arch.family == "opt" else 1)
        if not (arch.tied_embeddings and pp == 1):
            params += vocab_rows * h
    return params


def make_plan(
    arch: ModelArch,
    rank_config: RankConfig,
    layout: Layout | str,
    *,
    tp: int = 1,
    pp: int = 1,
    batch: int = 1,
    seq: int = 1,
    dtype_bytes: int = 4,
) -> Plan:
    """Plan every layer of ``arch`` for ``layout`` at TP ``tp`` and PP ``pp``."""
    from deinfer_megatron.models.build import check_parallel_sizes

    layout = Layout.parse(layout)
    check_parallel_sizes(arch, tp, pp)
    stages = _stage_bounds(arch.num_layers, pp)
    layers = [layer_plan(arch, rank_config, layout, tp, i, dtype_bytes) for i in range(arch.num_layers)]
    stage_params = [
        sum(l.params_per_rank for l in layers[a:b]) + _edge_params(arch, tp, pp, s)
        for s, (a, b) in enumerate(stages)
    ]
    kv_full = [sum(l.kv_bytes_per_token["full"] for l in layers[a:b]) for a, b in stages]
    kv_latent = [
        sum(l.kv_bytes_per_token["latent"] or l.kv_bytes_per_token["full"] for l in layers[a:b])
        for a, b in stages
    ]
    tokens = batch * seq
    totals = {
        "params_per_rank": max(stage_params),
        "params_per_stage_rank": stage_params,
        "collectives_per_token": sum(l.collectives for l in layers),
        "elements_per_token": sum(l.elements_per_token for l in layers),
        "elements_per_forward": sum(l.elements_per_token for l in layers) * tokens,
        "kv_bytes_per_token": {"full": max(kv_full), "latent": max(kv_latent)},
        "kv_bytes_for_batch": {"full": max(kv_full) * tokens, "latent": max(kv_latent) * tokens},
    }
    return Plan(layout.value, tp, pp, batch, seq, dtype_bytes, layers, stages, totals)
