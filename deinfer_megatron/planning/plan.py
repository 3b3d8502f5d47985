"""What a model costs per rank in a given layout, computed from its config and rank config.

For every transformer layer: whether it is dense or decomposed, its ranks, the parameters one
rank holds, the collectives it issues per token (kind and element count, the unit of
DESIGN.md §3) in a forward pass and in one training step (forward + backward of the
activations), and the KV-cache bytes per token one rank stores (full K/V, and rank-r latents).
The planner knows no layout: it walks the layers, takes each block's classes from the layout
table (``Layout.factor_classes``; None = Megatron's dense blocks) and asks those classes what
they cost (``cost``), without building them. The test suite checks the numbers against an
instrumented forward pass and the parameters a built model really allocates.
Collectives of the embedding and the output layer (Megatron's own) are not included, nor the
per-step (not per-token) sum of replicated KV heads' weight gradients.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from deinfer_megatron.arch.model import ModelArch, transformer_config
from deinfer_megatron.arch.ranks import AttentionRanks, MlpRanks
from deinfer_megatron.layers.attention import FactoredSelfAttention
from deinfer_megatron.layers.core_attention import MEGATRON
from deinfer_megatron.layers.costs import Cost
from deinfer_megatron.layers.dense import dense_attention_cost, dense_mlp_cost
from deinfer_megatron.layers.factored_linear import factored_mlp_cost
from deinfer_megatron.models.build import padded_vocab_size
from deinfer_megatron.parallel.topology import TPView
from deinfer_megatron.specs.builder import (factored_attention_submodules, require_dense_attention_fits,
                                            require_dense_mlp_fits)
from deinfer_megatron.specs.layout import BlockLayouts, Layout, LayoutPlan, as_plan
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
    layouts: dict[str, str] = field(default_factory=dict)  # {"attention": ..., "mlp": ...} as built
    backward_ops: list[tuple[str, int]] = field(default_factory=list)  # (kind, elements per token)
    training_collectives: int = 0  # forward + backward, per token
    training_elements_per_token: int = 0
    # a forward's activations per token row at the layer's widest block (``activation_elements``)
    activation_elements_per_token: int = 0
    score_heads: int = 0  # heads whose [rows, context] attention scores a core materialises


def activation_elements(hidden: int, *blocks: Cost) -> int:
    """Elements a forward holds per token row at the layer's widest block: the residual stream
    and the norm's output, plus every product's output of that block (gate, up and their
    product in a gated MLP are live at once; the sum over a block's products is that bound)."""
    return 2 * hidden + max(sum(g.count * g.n for g in block.gemms) for block in blocks)


def score_heads(attention: Cost) -> int:
    """Heads whose scores a core materialises (Megatron's ``DotProductAttention``: scores and
    probabilities, ``[b·heads, sq, sk]`` each); PyTorch's SDPA streams them."""
    return sum(2 * a.heads for a in attention.attends if a.core == MEGATRON)


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
            for key in ("collective_ops", "backward_ops"):
                layer[key] = [{"kind": k, "elements": e} for k, e in layer[key]]
        return out


# --------------------------------------------------------------------------- per-layer costs


def block_costs(config: Any, blocks: BlockLayouts, attn: AttentionRanks | None,
                 mlp: MlpRanks | None, tp: TPView, *, rotary: bool) -> tuple[Cost, Cost]:
    """(attention, MLP) cost on rank ``tp.rank``, each answered by the module the block is built
    as: Megatron's dense block where there are no ranks, else the decomposed block with the
    block's layout's factor classes in its slots. ``rotary``: the model's positions are RoPE
    (``ModelArch.rotary``; Megatron's dense attention then rotates its cached keys each step)."""
    attn_classes, mlp_classes = blocks.attention.factor_classes, blocks.mlp.factor_classes
    attention = (
        dense_attention_cost(config, tp, rotary=rotary)
        if attn is None
        else FactoredSelfAttention.cost(config, factored_attention_submodules(attn_classes), attn, tp)
    )
    ffn = (
        dense_mlp_cost(config, tp)
        if mlp is None
        else factored_mlp_cost(config, mlp_classes.column, mlp_classes.row, mlp, tp)
    )
    return attention, ffn


def _norm_params(arch: ModelArch) -> int:
    return 2 * arch.hidden_size * (2 if arch.model_family.norm_bias else 1)


def _rank_names(arch: ModelArch, rank_config: RankConfig, index: int) -> dict[str, int]:
    names = {**arch.attention_modules(index), **arch.mlp_modules(index)}
    return {role: rank_config.modules[n] for role, n in names.items() if n in rank_config.modules}


def layer_plan(
    arch: ModelArch,
    rank_config: RankConfig,
    layout: Layout | BlockLayouts,
    tp: int,
    index: int,
    dtype_bytes: int,
    *,
    config: Any = None,
) -> LayerPlan:
    """The plan of global layer ``index`` in ``layout`` (one for both blocks, or one per block);
    parameters are the maximum over the TP ranks.

    ``config`` is the model's Megatron ``TransformerConfig`` (built from ``arch`` when omitted):
    the costs are asked with the very values the layers are built from.
    """
    config = config if config is not None else transformer_config(arch, tp=tp, pp=1)
    ranks: LayerRanks = rank_config.layers[index]
    blocks = layout if isinstance(layout, BlockLayouts) else BlockLayouts(layout, layout)
    # The blocks as built: a block without factor classes (dense layout) is Megatron's dense one.
    attn = ranks.attention if blocks.attention.factor_classes is not None else None
    mlp = ranks.mlp if blocks.mlp.factor_classes is not None else None
    if attn is None:
        require_dense_attention_fits(arch.num_kv_heads, tp, index)
    if mlp is None:
        require_dense_mlp_fits(arch.ffn_hidden_size, tp, index)
    params = activations = scores = 0
    for rank in range(tp):
        attention, ffn = block_costs(config, blocks, attn, mlp, TPView(rank, tp), rotary=arch.rotary)
        params = max(params, attention.params + ffn.params + _norm_params(arch))
        activations = max(activations, activation_elements(arch.hidden_size, attention, ffn))
        scores = max(scores, score_heads(attention))
    ops = [(c.kind, c.elements) for c in attention.collectives + ffn.collectives]
    # the backward pass runs the blocks, and each block's parts, in reverse order
    backward = [(c.kind, c.elements) for c in (attention.backward + ffn.backward)[::-1]]
    full = 2 * attention.kv_heads * arch.head_dim * dtype_bytes
    latent = None if attn is None else (attn.k + attn.v) * dtype_bytes
    # kind and ranks describe the model; the dense layout serves the same factors multiplied out
    kind = {(True, True): "decomposed", (True, False): "attention-decomposed",
            (False, True): "mlp-decomposed", (False, False): "dense"}[
        (ranks.attention is not None, ranks.mlp is not None)]
    return LayerPlan(
        index=index,
        kind=kind,
        layouts={"attention": blocks.attention.value, "mlp": blocks.mlp.value},
        ranks=_rank_names(arch, rank_config, index),
        params_per_rank=params,
        collectives=len(ops),
        collective_ops=ops,
        elements_per_token=sum(e for _, e in ops),
        kv_bytes_per_token={"full": full, "latent": latent},
        backward_ops=backward,
        training_collectives=len(ops) + len(backward),
        training_elements_per_token=sum(e for _, e in ops + backward),
        activation_elements_per_token=activations,
        score_heads=scores,
    )


def logit_elements(padded_vocab: int, tp: int) -> int:
    """Vocabulary-wide elements alive per row of a forward that returns every row's logits (a
    perplexity pass; generation keeps the last row only): Megatron gathers the whole vocabulary
    on every rank, then hands it back transposed, a contiguous copy, while the gathered one is
    alive — and under TP the rank's own shard is alive too. Measured peak RSS per row and
    vocabulary entry: 1.91 at TP=1, 2.37 at TP=2 (against 2 and 2.5 here)."""
    return 2 * padded_vocab + (padded_vocab // tp if tp > 1 else 0)


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
        params += vocab_rows * h + (0 if arch.rotary else arch.max_positions * h)  # learned positions
    if stage == pp - 1:
        params += h * (2 if arch.model_family.norm_bias else 1)
        if not (arch.tied_embeddings and pp == 1):
            params += vocab_rows * h
    return params


def make_plan(
    arch: ModelArch,
    rank_config: RankConfig,
    layout: Layout | LayoutPlan,
    *,
    tp: int = 1,
    pp: int = 1,
    batch: int = 1,
    seq: int = 1,
    dtype_bytes: int = 4,
) -> Plan:
    """Plan every layer of ``arch`` for ``layout`` (one layout, or a plan with one per block)
    at TP ``tp`` and PP ``pp``, sizes that split the model (``check_parallel_sizes``, checked
    where a command reads them)."""

    assert tp >= 1 and pp >= 1 and arch.num_layers % pp == 0, f"unchecked sizes --tp {tp} --pp {pp}"
    plan = as_plan(layout, arch.num_layers)
    stages = _stage_bounds(arch.num_layers, pp)
    config = transformer_config(arch, tp=tp, pp=pp)
    layers = [layer_plan(arch, rank_config, plan.layers[i], tp, i, dtype_bytes, config=config)
              for i in range(arch.num_layers)]
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
        "training_collectives_per_token": sum(l.training_collectives for l in layers),
        "training_elements_per_token": sum(l.training_elements_per_token for l in layers),
        "elements_per_training_step": sum(l.training_elements_per_token for l in layers) * tokens,
        "kv_bytes_per_token": {"full": max(kv_full), "latent": max(kv_latent)},
        "kv_bytes_for_batch": {"full": max(kv_full) * tokens, "latent": max(kv_latent) * tokens},
        # activations live one layer at a time: the widest layer bounds a forward's
        "activation_elements_per_token": max(l.activation_elements_per_token for l in layers),
        "score_heads": max(l.score_heads for l in layers),
        "logit_elements_per_token": logit_elements(padded_vocab_size(arch.vocab_size, tp), tp),
    }
    return Plan(plan.value, tp, pp, batch, seq, dtype_bytes, layers, stages, totals)
