"""The Hugging Face → Megatron name table (``hf_names``) against independent references.

- ``NameMap.target`` of every tensor of tiny LLaMA, Qwen2 and OPT models (transformers' own
  state dicts), dense and decomposed, against targets written out here by hand — and every
  target is a parameter of a stage that Megatron's ``GPTModel`` and our spec really build.
- ``expected_shapes`` against the shapes transformers gives the same tensors, including tied
  embeddings (``lm_head.weight`` optional) and OPT's two extra position rows.
"""

from __future__ import annotations

import re

import pytest

from deinfer_megatron.arch.family import FAMILIES as FAMILIES_REGISTRY
from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.checkpoints.hf_names import (
    FINAL_NORM, OUTPUT_LAYER, POSITION_EMBEDDINGS, WORD_EMBEDDINGS, NameMap, Target, expected_shapes, global_names,
    norm_names,
)
from deinfer_megatron.specs.rank_config import RankConfig
from tests.helpers.distributed import run_ranks
from tests.helpers.tiny_models import TINY_CONFIGS, decompose_randomly, mixed_ranks, random_hf_model

FAMILIES = ("llama", "qwen2", "opt")
DECOMPOSED_LAYERS = [0, 2]  # layers 1 and 3 stay dense

# Global tensors: Hugging Face name → ours.
GLOBAL = {
    "llama": {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
              "model.norm.weight": "decoder.final_layernorm.weight", "lm_head.weight": "output_layer.weight"},
    "opt": {"model.decoder.embed_tokens.weight": "embedding.word_embeddings.weight",
            "model.decoder.embed_positions.weight": "embedding.position_embeddings.weight",
            "model.decoder.final_layer_norm.weight": "decoder.final_layernorm.weight",
            "model.decoder.final_layer_norm.bias": "decoder.final_layernorm.bias",
            "lm_head.weight": "output_layer.weight"},
}
GLOBAL["qwen2"] = GLOBAL["llama"]

# Per layer, dense: suffix after "<prefix>.<i>." → (ours after "decoder.layers.<i>.", shard id).
LLAMA_DENSE = {
    "self_attn.q_proj.weight": ("self_attention.linear_qkv.weight", "q"),
    "self_attn.k_proj.weight": ("self_attention.linear_qkv.weight", "k"),
    "self_attn.v_proj.weight": ("self_attention.linear_qkv.weight", "v"),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", None),
    "mlp.gate_proj.weight": ("mlp.linear_fc1.weight", 0),
    "mlp.up_proj.weight": ("mlp.linear_fc1.weight", 1),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", None),
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", None),
}
LLAMA_DECOMPOSED = {
    "self_attn.q_proj.v": ("self_attention.linear_qkv_down.weight", 0),
    "self_attn.k_proj.v": ("self_attention.linear_qkv_down.weight", 1),
    "self_attn.v_proj.v": ("self_attention.linear_qkv_down.weight", 2),
    "self_attn.q_proj.u": ("self_attention.linear_q_up.weight", 0),
    "self_attn.k_proj.u": ("self_attention.linear_k_up.weight", 0),
    "self_attn.v_proj.u": ("self_attention.linear_v_up.weight", 0),
    "self_attn.o_proj.v": ("self_attention.linear_proj.down.weight", 0),
    "self_attn.o_proj.u": ("self_attention.linear_proj.up.weight", 0),
    "mlp.gate_proj.v": ("mlp.linear_fc1.down.weight", 0),
    "mlp.up_proj.v": ("mlp.linear_fc1.down.weight", 1),
    "mlp.gate_proj.u": ("mlp.linear_fc1.up.weight", 0),
    "mlp.up_proj.u": ("mlp.linear_fc1.up.weight", 1),
    "mlp.down_proj.v": ("mlp.linear_fc2.down.weight", 0),
    "mlp.down_proj.u": ("mlp.linear_fc2.up.weight", 0),
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", None),
}
QKV_BIAS_DENSE = {f"self_attn.{p}_proj.bias": ("self_attention.linear_qkv.bias", p) for p in "qkv"}
QKV_BIAS_DECOMPOSED = {f"self_attn.{p}_proj.bias": (f"self_attention.linear_{p}_up.bias", 0) for p in "qkv"}
OPT_DENSE = {
    **{f"self_attn.{p}_proj.{s}": (f"self_attention.linear_qkv.{s}", p) for p in "qkv" for s in ("weight", "bias")},
    **{f"self_attn.out_proj.{s}": (f"self_attention.linear_proj.{s}", None) for s in ("weight", "bias")},
    **{f"fc1.{s}": (f"mlp.linear_fc1.{s}", 0) for s in ("weight", "bias")},
    **{f"fc2.{s}": (f"mlp.linear_fc2.{s}", None) for s in ("weight", "bias")},
    **{f"self_attn_layer_norm.{s}": (f"input_layernorm.{s}", None) for s in ("weight", "bias")},
    **{f"final_layer_norm.{s}": (f"pre_mlp_layernorm.{s}", None) for s in ("weight", "bias")},
}
OPT_DECOMPOSED = {
    **{f"self_attn.{p}_proj.v": ("self_attention.linear_qkv_down.weight", i) for i, p in enumerate("qkv")},
    **{f"self_attn.{p}_proj.u": (f"self_attention.linear_{p}_up.weight", 0) for p in "qkv"},
    **QKV_BIAS_DECOMPOSED,
    "self_attn.out_proj.v": ("self_attention.linear_proj.down.weight", 0),
    "self_attn.out_proj.u": ("self_attention.linear_proj.up.weight", 0),
    "self_attn.out_proj.bias": ("self_attention.linear_proj.up.bias", 0),
    **{f"{m}.{s}": (f"mlp.linear_{m}.{part}", 0) for m in ("fc1", "fc2")
       for s, part in (("v", "down.weight"), ("u", "up.weight"), ("bias", "up.bias"))},
    **{k: v for k, v in OPT_DENSE.items() if "layer_norm" in k},
}
PER_LAYER = {
    "llama": (LLAMA_DENSE, LLAMA_DECOMPOSED),
    "qwen2": ({**LLAMA_DENSE, **QKV_BIAS_DENSE}, {**LLAMA_DECOMPOSED, **QKV_BIAS_DECOMPOSED}),
    "opt": (OPT_DENSE, OPT_DECOMPOSED),
}


def _case(family: str, decomposed: bool):
    """(arch, rank config, Hugging Face state dict as a decomposed folder holds it)."""
    hf = random_hf_model(family)
    ranks = mixed_ranks(hf, DECOMPOSED_LAYERS) if decomposed else {}
    state = decompose_randomly(hf, ranks) if decomposed else dict(hf.state_dict())
    arch = arch_from_hf_config(hf.config.to_dict())
    return arch, RankConfig.from_mapping(ranks, arch), state


def _expected_target(family: str, name: str, rank_config: RankConfig) -> Target:
    if name in GLOBAL[family]:
        return Target(GLOBAL[family][name], None, None)
    m = re.fullmatch(r"model\.(?:decoder\.)?layers\.(\d+)\.(.+)", name)
    assert m, name
    layer = int(m.group(1))
    dense, decomposed = PER_LAYER[family]
    table = decomposed if layer in DECOMPOSED_LAYERS and rank_config.modules else dense
    ours, shard = table[m.group(2)]
    return Target(f"decoder.layers.{layer}.{ours}", shard, layer)


@pytest.mark.parametrize("decomposed", [False, True], ids=["dense", "decomposed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_hugging_face_tensor_has_its_target(family, decomposed) -> None:
    arch, rank_config, state = _case(family, decomposed)
    names = NameMap(arch, rank_config)
    for name in state:
        assert names.target(name) == _expected_target(family, name, rank_config), name


def test_names_outside_the_model_and_disagreements() -> None:
    arch, rank_config, _ = _case("llama", True)
    names = NameMap(arch, rank_config)
    assert names.target("model.layers.4.self_attn.q_proj.weight") is None  # only 4 layers
    assert names.target("model.rotary_emb.inv_freq") is None
    assert names.target("model.layers.1.self_attn.q_proj.scale") is None
    with pytest.raises(ValueError, match="dense weight but the rank config decomposes"):
        names.target("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match="low-rank factor but the rank config keeps"):
        names.target("model.layers.1.mlp.up_proj.u")


def _built_parameters(cases: list[tuple[str, bool]]) -> dict[str, list[str]]:
    """Rank body: the parameter names of each family's TP=1 stage, as Megatron builds it."""
    from deinfer_megatron.models.build import build_stage
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.specs.layout import Layout

    groups = init_parallel(1, 1)
    out = {}
    try:
        for family, decomposed in cases:
            arch, rank_config, _ = _case(family, decomposed)
            stage = build_stage(arch, rank_config, Layout.DEINFER if decomposed else Layout.DENSE, groups)
            out[f"{family}/{decomposed}"] = [n for n, _ in stage.model.named_parameters()]
    finally:
        shutdown()
    return out


def test_targets_are_the_parameters_megatron_builds() -> None:
    """Every target is a parameter of the built stage, every parameter is some target's, and a
    parameter with shard ids gets each exactly once. A tied head has no parameter of its own."""
    cases = [(f, d) for f in FAMILIES for d in (False, True)]
    built = run_ranks(1, _built_parameters, cases, timeout=300)[0]
    for family, decomposed in cases:
        arch, rank_config, state = _case(family, decomposed)
        names = NameMap(arch, rank_config)
        targets = [names.target(n) for n in state if not (arch.tied_embeddings and n == "lm_head.weight")]
        assert set(built[f"{family}/{decomposed}"]) == {t.name for t in targets}, (family, decomposed)
        pairs = [(t.name, t.shard) for t in targets]
        assert len(pairs) == len(set(pairs)), (family, decomposed)


@pytest.mark.parametrize("decomposed", [False, True], ids=["dense", "decomposed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_expected_shapes_are_the_shapes_transformers_gives(family, decomposed) -> None:
    arch, rank_config, state = _case(family, decomposed)
    shapes = expected_shapes(arch, rank_config)
    required = {n for n, (_, req) in shapes.items() if req}
    assert required <= set(state) <= set(shapes)
    assert {n: tuple(t.shape) for n, t in state.items()} == {n: shapes[n][0] for n in state}
    # tied embeddings: the head is optional (transformers lists it, a decomposed folder may not)
    assert ("lm_head.weight" in required) == (not arch.tied_embeddings)
    if family == "opt":
        rows = TINY_CONFIGS["opt"]["max_position_embeddings"] + 2  # OPT's position offset
        assert shapes["model.decoder.embed_positions.weight"][0] == (rows, arch.hidden_size)


@pytest.mark.parametrize("family", sorted(FAMILIES_REGISTRY))
def test_every_registered_family_has_its_name_table_entries(family) -> None:
    """A record's ``hf_names`` key has global and norm tables, with a token embedding, a final
    norm and an output layer, and a learned position table exactly when positions are learned."""
    fam = FAMILIES_REGISTRY[family]
    ours = set(global_names(fam).values())
    assert {WORD_EMBEDDINGS, FINAL_NORM, OUTPUT_LAYER} <= ours
    assert (POSITION_EMBEDDINGS in ours) == (not fam.rotary)
    assert norm_names(fam), family
    assert all(n.endswith(".weight") for n in norm_names(fam)) == (not fam.norm_bias)
