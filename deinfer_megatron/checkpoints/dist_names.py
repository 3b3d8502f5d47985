"""The global tensors of a (decomposed) ``GPTModel`` dist checkpoint ↔ Hugging Face names.

A checkpoint saved from this project's ``GPTModel.sharded_state_dict()`` holds, per layer
(``decoder.layers.<i>.``, global numbers: decomposed layers have per-layer ranks, so layers are
never stacked):

* each factor section under ``<our parameter>.section<s>`` (``layers.sharded_state``), e.g.
  ``decoder.layers.0.self_attention.linear_qkv_down.weight.section1`` = ``V_k`` (r_k × h);
* Megatron's own tensors as Megatron saves them: a dense fused QKV in query-group order, a
  gated fc1 as ``[gate; up]``, the vocabulary padded to a multiple of the saving TP size.

Both directions read the one name table (``hf_names.NameMap``) and the fused layouts of
``megatron_layout``, so this module only decides which global key a Hugging Face tensor lives
under and which rows of it are that tensor. The conversion is exact: no arithmetic, only
slicing, concatenation and (for the vocabulary) zero padding rows that are cut again.
"""

from __future__ import annotations

from typing import Mapping

import torch

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.checkpoints.hf_names import NameMap, embedding_name, expected_shapes
from deinfer_megatron.checkpoints.megatron_layout import OPT_POSITION_OFFSET, gated_rows, qkv_pieces
from deinfer_megatron.layers.sharded_state import section_key
from deinfer_megatron.parallel.topology import Span
from deinfer_megatron.specs.rank_config import RankConfig

_POSITIONS = "model.decoder.embed_positions.weight"


def _pieces(arch: ModelArch, shard: object) -> list[tuple[slice, slice]] | None:
    """(rows of the global Megatron tensor, rows of the Hugging Face tensor) of a fused dense
    parameter's piece ``shard``; None: the Hugging Face tensor is the whole parameter."""
    if isinstance(shard, str):  # q / k / v of a dense fused QKV
        return qkv_pieces(arch, Span.whole(arch.num_kv_heads), shard)
    if shard is not None and arch.gated:  # gate / up of a dense gated fc1
        return [gated_rows(Span.whole(arch.ffn_hidden_size), int(shard))]
    return None


def _table(arch: ModelArch, rank_config: RankConfig) -> dict[str, list[tuple[str, str, object]]]:
    """Global checkpoint key → its Hugging Face tensors as ``(name, kind, shard)``; kind is
    ``"section"`` (the key is one factor section) or ``"dense"`` (Megatron's own tensor)."""
    names = NameMap(arch, rank_config)
    out: dict[str, list[tuple[str, str, object]]] = {}
    for hf_name in expected_shapes(arch, rank_config):
        if arch.tied_embeddings and hf_name == "lm_head.weight":
            continue
        target = names.target(hf_name)
        assert target is not None, f"hf_names lists {hf_name} but maps it nowhere"
        module, _, suffix = hf_name.rpartition(".")
        factored = module in rank_config.modules and suffix in ("u", "v", "bias")
        if factored:
            out[section_key(target.name, int(target.shard))] = [(hf_name, "section", target.shard)]
        else:
            out.setdefault(target.name, []).append((hf_name, "dense", target.shard))
    return out


def dist_to_hf(saved: Mapping[str, torch.Tensor], arch: ModelArch, rank_config: RankConfig) -> dict[str, torch.Tensor]:
    """Global checkpoint tensors → Hugging Face tensors (decomposed matrices as ``.u``/``.v``).

    The vocabulary is cut to ``arch.vocab_size`` rows. OPT's position table lacks the two
    offset rows Hugging Face keeps in front (Megatron's learned positions start at position 0),
    which no forward pass reads: they come back as zeros.
    Raises:
        ValueError: a tensor missing, of another shape than config and rank config imply, or
            one the rank config does not explain (a checkpoint of another model).
    """
    src = dict(saved)
    if arch.tied_embeddings:
        src.pop("output_layer.weight", None)  # a pipeline stage's copy of the embedding
    expected = expected_shapes(arch, rank_config)
    vocab_rows = {embedding_name(arch), "lm_head.weight"}
    out: dict[str, torch.Tensor] = {}
    for key, parts in _table(arch, rank_config).items():
        if key not in src:
            raise ValueError(f"the checkpoint lacks '{key}', which its config.json and rank_config.json imply")
        tensor = src.pop(key)
        for hf_name, kind, shard in parts:
            pieces = None if kind == "section" else _pieces(arch, shard)
            if pieces is None:
                t = tensor[: arch.vocab_size] if hf_name in vocab_rows else tensor
            else:
                t = torch.cat([tensor[dst] for dst, _ in sorted(pieces, key=lambda p: p[1].start)])
            if hf_name == _POSITIONS:
                t = torch.cat([t.new_zeros(OPT_POSITION_OFFSET, t.shape[1]), t])
            if tuple(t.shape) != expected[hf_name][0]:
                raise ValueError(f"checkpoint tensor '{key}' gives {hf_name} the shape {list(t.shape)}, but "
                                 f"config.json and rank_config.json imply {list(expected[hf_name][0])}")
            out[hf_name] = t.clone()
    if src:
        raise ValueError(f"the checkpoint holds tensors its rank_config.json does not explain, e.g. "
                         f"{sorted(src)[:3]}; it is not a checkpoint of this model")
    return out
