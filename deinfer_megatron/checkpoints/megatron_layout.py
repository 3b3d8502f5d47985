"""How Megatron lays Hugging Face matrices out, and dense Megatron ↔ Hugging Face state dicts.

Two of Megatron's parameters fuse several Hugging Face matrices:

- ``linear_qkv``: per query group ``g``, the rows ``[q heads of g; k_g; v_g]``, groups in order
  (``qkv_pieces``);
- a gated ``linear_fc1``: each tensor-parallel rank holds ``[gate[span]; up[span]]`` (Megatron's
  ``stride=2``), so a dense (TP=1) fc1 is ``[gate; up]`` (``gated_rows``).

The shard loaders (``loader.py``) use these pieces to fill one rank's slice, and the Megatron
checkpoint reader uses the same pieces with the whole dimension to undo the fusion. Names come
from the one table of ``hf_names``, read forwards by the loaders and backwards here
(``_our_sources``), so a name or layout exists in exactly one place.
"""

from __future__ import annotations

from typing import Mapping

import torch

from deinfer_megatron.arch.family import FAMILIES, OPT
from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.checkpoints.hf_names import NameMap, embedding_name, expected_shapes
from deinfer_megatron.parallel.topology import Span
from deinfer_megatron.specs.rank_config import RankConfig

OPT_POSITION_OFFSET = OPT.position_offset  # rows before position 0 of OPT's table (loader.py, dist_names.py)

Pieces = list[tuple[slice, slice]]  # (rows of our parameter, rows of the Hugging Face tensor)


def qkv_pieces(arch: ModelArch, groups: Span, role: str) -> Pieces:
    """Where the Hugging Face ``role`` (q, k or v) projection sits in a fused QKV that holds the
    query groups ``groups``: one (our rows, Hugging Face rows) pair per group."""
    d, per_group = arch.head_dim, arch.num_heads // arch.num_kv_heads
    block = (per_group + 2) * d
    out = []
    for j, g in enumerate(range(groups.start, groups.stop)):
        base = j * block
        if role == "q":
            out.append((slice(base, base + per_group * d), slice(g * per_group * d, (g + 1) * per_group * d)))
        else:
            at = base + per_group * d + (0 if role == "k" else d)
            out.append((slice(at, at + d), slice(g * d, (g + 1) * d)))
    return out


def gated_rows(span: Span, shard: int) -> tuple[slice, slice]:
    """Where gate (``shard`` 0) or up (1) rows ``span`` sit in a rank's gated fc1
    ``[gate[span]; up[span]]``: (our rows, Hugging Face rows)."""
    base = int(shard) * span.size
    return slice(base, base + span.size), span.slice


def _dense_pieces(arch: ModelArch, shard: object) -> Pieces | None:
    """The pieces of a dense (TP=1) parameter filled by shard id ``shard``; None: the whole tensor."""
    if isinstance(shard, str):  # q / k / v of the fused QKV
        return qkv_pieces(arch, Span.whole(arch.num_kv_heads), shard)
    if shard is not None and arch.gated:  # gate / up of the gated fc1
        return [gated_rows(Span.whole(arch.ffn_hidden_size), int(shard))]
    return None


def _check_family(arch: ModelArch) -> None:
    """Megatron's learned position table starts at position 0: a family whose Hugging Face table
    keeps offset rows in front has no lossless dense Megatron state dict."""
    fam = arch.model_family
    if fam.position_offset:
        served = "/".join(f.title for f in FAMILIES.values() if not f.position_offset)
        raise ValueError(f"dense Megatron state dicts of {fam.title} models are not supported (Megatron's "
                         f"position table lacks the {fam.position_offset} offset rows Hugging Face keeps); "
                         f"only {served}")


def _our_sources(arch: ModelArch) -> dict[str, list[tuple[str, object]]]:
    """Our dense parameter name → its Hugging Face tensors and shard ids: ``NameMap`` read
    backwards, over every name ``expected_shapes`` lists. A tied model has no output layer."""
    dense = RankConfig.dense(arch)
    names = NameMap(arch, dense)
    out: dict[str, list[tuple[str, object]]] = {}
    for hf_name in expected_shapes(arch, dense):
        if arch.tied_embeddings and hf_name == "lm_head.weight":
            continue
        target = names.target(hf_name)
        assert target is not None, f"hf_names lists {hf_name} but maps it nowhere"
        out.setdefault(target.name, []).append((hf_name, target.shard))
    return out


def hf_to_megatron(hf: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """Hugging Face LLaMA/Qwen2 tensors → a dense (TP=1) Megatron ``GPTModel`` state dict.

    Local-spec names with global layer numbers, fused QKV and ``[gate; up]`` fc1; a tied model's
    ``lm_head.weight`` is left out (Megatron shares the embedding). Meta tensors give the shapes.
    """
    _check_family(arch)
    table = _our_sources(arch)
    known = {n for sources in table.values() for n, _ in sources} | {"lm_head.weight"}
    unknown = sorted(set(hf) - known)
    if unknown:
        raise ValueError(f"{unknown[:3]} are not tensors of this {arch.family} model; check the model's config")
    out = {}
    for ours, sources in table.items():
        missing = [n for n, _ in sources if n not in hf]
        if missing:
            raise ValueError(f"the Hugging Face state dict lacks {missing[:3]}, which {ours} is made of")
        first = hf[sources[0][0]]
        pieces = {n: _dense_pieces(arch, shard) for n, shard in sources}
        if pieces[sources[0][0]] is None:
            out[ours] = first
            continue
        rows = sum(dst.stop - dst.start for p in pieces.values() for dst, _ in p)
        fused = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
        for name, parts in pieces.items():
            for dst, src in parts:
                fused[dst] = hf[name][src]
        out[ours] = fused
    return out


def megatron_shapes(arch: ModelArch) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every parameter of a dense Megatron ``GPTModel`` → ``(shape, required)``, as ``arch``
    implies (vocabulary rows: ``arch.vocab_size``). The output layer of a tied model is optional
    (a pipeline-parallel run keeps a copy of the embedding there)."""
    meta = {n: torch.empty(shape, device="meta") for n, (shape, _) in expected_shapes(arch, RankConfig.dense(arch)).items()}
    out = {name: (tuple(t.shape), True) for name, t in hf_to_megatron(meta, arch).items()}
    if arch.tied_embeddings:
        out["output_layer.weight"] = ((arch.vocab_size, arch.hidden_size), False)
    return out


def megatron_to_hf(dense: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """A dense (TP=1) Megatron ``GPTModel`` state dict → Hugging Face LLaMA/Qwen2 tensors (float32).

    The vocabulary is cut to ``arch.vocab_size`` rows; an ``output_layer.weight`` of a tied
    model (a pipeline copy of the embedding) is dropped. The inverse of ``hf_to_megatron``.
    Raises:
        ValueError: a tensor missing, unexplained, or of a size the architecture contradicts.
    """
    _check_family(arch)
    src = dict(dense)
    if arch.tied_embeddings:
        src.pop("output_layer.weight", None)
    vocab_rows = {embedding_name(arch), "lm_head.weight"}
    out: dict[str, torch.Tensor] = {}
    for ours, sources in _our_sources(arch).items():
        if ours not in src:
            raise ValueError(f"the checkpoint lacks '{ours}', which its args imply; it does not match its own args")
        tensor = src.pop(ours).to(torch.float32)
        pieces = {n: _dense_pieces(arch, shard) for n, shard in sources}
        if pieces[sources[0][0]] is None:
            name = sources[0][0]
            out[name] = tensor[: arch.vocab_size].clone() if name in vocab_rows else tensor
            continue
        _check_rows(ours, tensor, sum(dst.stop - dst.start for p in pieces.values() for dst, _ in p))
        for name, parts in pieces.items():
            out[name] = torch.cat([tensor[dst] for dst, _ in sorted(parts, key=lambda p: p[1].start)]).clone()
    if src:
        raise ValueError(f"the checkpoint has tensors its args do not explain, e.g. {sorted(src)[:3]}; check its args")
    for module, shape in arch.linear_shapes().items():
        got = tuple(out[f"{module}.weight"].shape)
        if got != shape:
            raise ValueError(f"{module}.weight has shape {got}, but the checkpoint's args imply {shape}")
    return out


def _check_rows(name: str, t: torch.Tensor, rows: int) -> None:
    if t.shape[0] != rows:
        raise ValueError(f"'{name}' has {t.shape[0]} rows but the args imply {rows}; the checkpoint contradicts them")
