"""Hugging Face ↔ dense Megatron state dicts: one table, read both ways.

A tiny LLaMA (GQA, untied) and Qwen2 (QKV bias, tied, 2 KV heads) state dict goes to dense
Megatron names and layout and back unchanged. The Megatron layout is checked against Megatron's
layout written out here by hand: fused QKV rows are, per query group, ``[q heads; k; v]``, and
the gated fc1 is ``[gate; up]``.
"""

from __future__ import annotations

import pytest
import torch

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.checkpoints.megatron_layout import hf_to_megatron, megatron_shapes, megatron_to_hf
from tests.helpers.tiny_models import random_hf_model

FAMILIES = ("llama", "qwen2")


def _model(family: str):
    hf = random_hf_model(family)
    arch = arch_from_hf_config(hf.config.to_dict())
    sd = dict(hf.state_dict())
    if arch.tied_embeddings:
        sd.pop("lm_head.weight")
    return arch, sd


def _megatron_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's fused QKV from Hugging Face q, k, v: group g holds its q heads, then k_g, v_g."""
    qs, ks, vs = q.chunk(groups), k.chunk(groups), v.chunk(groups)
    return torch.cat([torch.cat([qs[g], ks[g], vs[g]]) for g in range(groups)])


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_the_identity(family) -> None:
    arch, sd = _model(family)
    dense = hf_to_megatron(sd, arch)
    back = megatron_to_hf(dense, arch)
    assert sorted(back) == sorted(sd)
    for name, tensor in sd.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_megatron_names_and_layout(family) -> None:
    arch, sd = _model(family)
    dense = hf_to_megatron(sd, arch)
    per_layer = {"input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.linear_qkv.weight",
                 "self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    if family == "qwen2":
        per_layer.add("self_attention.linear_qkv.bias")
    names = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    names |= {f"decoder.layers.{i}.{n}" for i in range(arch.num_layers) for n in per_layer}
    if not arch.tied_embeddings:
        names.add("output_layer.weight")
    assert set(dense) == names
    assert {n: tuple(t.shape) for n, t in dense.items()} == {n: s for n, (s, req) in megatron_shapes(arch).items() if req}
    for i in range(arch.num_layers):
        hf, meg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for suffix in ("weight", "bias") if family == "qwen2" else ("weight",):
            q, k, v = (sd[f"{hf}self_attn.{p}_proj.{suffix}"] for p in "qkv")
            assert torch.equal(dense[f"{meg}self_attention.linear_qkv.{suffix}"],
                               _megatron_qkv(q, k, v, arch.num_kv_heads))
        gate, up = sd[f"{hf}mlp.gate_proj.weight"], sd[f"{hf}mlp.up_proj.weight"]
        assert torch.equal(dense[f"{meg}mlp.linear_fc1.weight"], torch.cat([gate, up]))
        assert torch.equal(dense[f"{meg}self_attention.linear_proj.weight"], sd[f"{hf}self_attn.o_proj.weight"])
        assert torch.equal(dense[f"{meg}pre_mlp_layernorm.weight"], sd[f"{hf}post_attention_layernorm.weight"])


def test_padded_vocabulary_and_pipeline_copy_of_a_tied_head() -> None:
    """Megatron pads the vocabulary and, across pipeline stages, keeps a copy of a tied
    embedding in the output layer: both are dropped going back."""
    arch, sd = _model("qwen2")
    dense = hf_to_megatron(sd, arch)
    padded = torch.cat([dense["embedding.word_embeddings.weight"], torch.zeros(3, arch.hidden_size)])
    dense["embedding.word_embeddings.weight"] = padded
    dense["output_layer.weight"] = padded.clone()
    back = megatron_to_hf(dense, arch)
    assert sorted(back) == sorted(sd)
    assert torch.equal(back["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])


def test_missing_and_unexplained_tensors_are_errors() -> None:
    arch, sd = _model("llama")
    dense = hf_to_megatron(sd, arch)
    with pytest.raises(ValueError, match="lacks 'decoder.layers.2.mlp.linear_fc2.weight'"):
        megatron_to_hf({k: v for k, v in dense.items() if k != "decoder.layers.2.mlp.linear_fc2.weight"}, arch)
    with pytest.raises(ValueError, match="do not explain, e.g. \\['decoder.layers.0.extra'\\]"):
        megatron_to_hf({**dense, "decoder.layers.0.extra": torch.zeros(1)}, arch)
    short = {**dense, "decoder.layers.1.mlp.linear_fc1.weight": torch.zeros(10, arch.hidden_size)}
    with pytest.raises(ValueError, match="linear_fc1.weight' has 10 rows but the args imply 192"):
        megatron_to_hf(short, arch)
    with pytest.raises(ValueError, match="not tensors of this llama model"):
        hf_to_megatron({**sd, "model.layers.0.mlp.extra.weight": torch.zeros(1)}, arch)


def test_a_family_with_offset_position_rows_is_refused_in_one_line() -> None:
    hf = random_hf_model("opt")
    arch = arch_from_hf_config(hf.config.to_dict())
    for convert in (hf_to_megatron, megatron_to_hf):
        with pytest.raises(ValueError) as err:
            convert(dict(hf.state_dict()), arch)
        assert str(err.value) == ("dense Megatron state dicts of OPT models are not supported (Megatron's position "
                                  "table lacks the 2 offset rows Hugging Face keeps); only LLaMA/Qwen2")
