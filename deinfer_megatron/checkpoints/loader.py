"""Fill a built (empty) model stage from Hugging Face-named tensors, reading only local shards.

Our factor modules say how to fill their parameters (``loader_for``); ``megatron_loader`` does
the same for Megatron-native modules (embeddings, norms, dense linears, the output layer), from
what each module is. ``load_stage`` routes every source tensor through ``NameMap`` to its
parameter's loader and checks that every parameter of the stage was filled completely.
Loaders are looked up when loading, never stored on parameters (``to_empty`` drops them).

The fused layouts (Megatron's QKV groups, the gated fc1's ``[gate; up]`` per rank) are
``megatron_layout``'s, shared with the reader of Megatron checkpoints, which undoes them.

A *source* is any mapping from Hugging Face names to tensors or lazily-read slices (an
in-memory state dict, or safetensors files opened with ``safe_open``): loaders slice before
reading, so a rank never materialises another rank's shard of a large matrix.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding

from deinfer_megatron.checkpoints.hf_names import NameMap, embedding_name
from deinfer_megatron.checkpoints.megatron_layout import OPT_POSITION_OFFSET, gated_rows, qkv_pieces
from deinfer_megatron.layers.dense import CountedRowParallelLinear
from deinfer_megatron.layers.factors import read_block
from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.parallel.topology import Span, TPView, balanced_split
from deinfer_megatron.specs.rank_config import RankConfig

Loader = Callable[[nn.Parameter, Any, Any], None]


def _replicated(param: nn.Parameter, source: Any, shard: Any) -> None:
    param.data.copy_(read_block(source, slice(None)).reshape(param.shape))


def _rows(span: Span, valid: int | None = None, offset: int = 0) -> Loader:
    """This rank's rows ``span`` of the source (shifted by ``offset`` source rows); rows at or
    past ``valid`` (vocabulary padding) are zeros."""
    n = span.size if valid is None else max(0, min(span.stop, valid) - span.start)

    def load(param: nn.Parameter, source: Any, shard: Any) -> None:
        if n:
            start = span.start + offset
            param.data[:n].copy_(read_block(source, slice(start, start + n)))
        param.data[n:].zero_()

    return load


def _cols(span: Span) -> Loader:
    def load(param: nn.Parameter, source: Any, shard: Any) -> None:
        param.data.copy_(read_block(source, slice(None), span.slice))

    return load


def _stacked(span: Span) -> Loader:
    """Gated fc1 (Megatron ``stride=2``): this rank holds ``[gate[span]; up[span]]``."""

    def load(param: nn.Parameter, source: Any, shard: Any) -> None:
        dst, src = gated_rows(span, shard)
        param.data[dst].copy_(read_block(source, src))

    return load


def _fused_qkv(arch: ModelArch, tp: TPView) -> Loader:
    """Megatron's fused QKV: per local query group g, ``[q heads of g; k_g; v_g]``."""
    groups = balanced_split(arch.num_kv_heads, tp)

    def load(param: nn.Parameter, source: Any, shard: Any) -> None:
        for dst, src in qkv_pieces(arch, groups, shard):
            param.data[dst].copy_(read_block(source, src))

    return load


def megatron_loader(module: nn.Module, leaf: str, pname: str, arch: ModelArch) -> tuple[Loader, int] | None:
    """``(loader, number of shard ids)`` for parameter ``pname`` of a Megatron-native module
    named ``leaf`` in its parent, or None when the module is not one we know how to load."""
    if isinstance(module, VocabParallelEmbedding):
        span = Span(module.num_embeddings, module.vocab_start_index, module.vocab_end_index)
        return _rows(span, valid=arch.vocab_size), 1
    if isinstance(module, CountedRowParallelLinear):
        if pname == "bias":
            return _replicated, 1
        return _cols(balanced_split(module.input_size, TPView.of(module.tp_group))), 1
    if isinstance(module, ColumnParallelLinear):
        tp = TPView.of(module.tp_group)
        if leaf == "linear_qkv":
            return _fused_qkv(arch, tp), 3
        if leaf == "linear_fc1" and arch.gated:
            return _stacked(balanced_split(arch.ffn_hidden_size, tp)), 2
        valid = arch.vocab_size if leaf == "output_layer" else None
        return _rows(balanced_split(module.output_size, tp), valid=valid), 1
    if leaf == "position_embeddings":
        return _rows(Span.whole(module.weight.shape[0]), offset=OPT_POSITION_OFFSET), 1
    if "layernorm" in leaf or isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return _replicated, 1
    return None


def _loaders(model: nn.Module, arch: ModelArch) -> dict[str, tuple[Loader, int]]:
    out = {}
    for mname, module in model.named_modules():
        leaf = mname.rpartition(".")[2]
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            found = (
                module.loader_for(pname) if hasattr(module, "loader_for")
                else megatron_loader(module, leaf, pname, arch)
            )
            if found is None:
                raise AssertionError(f"no loader for parameter {full} ({type(module).__name__})")
            out[full] = found
    return out


class MultipliedOut(Mapping[str, Any]):
    """A decomposed source seen as dense: ``<module>.weight = <module>.u @ <module>.v``.

    Used to serve a decomposed checkpoint in the dense layout, and as the reference model in
    parity tests (the same factors, multiplied out).
    """

    def __init__(self, source: Mapping[str, Any], rank_config: RankConfig) -> None:
        self.source = source
        self.modules = set(rank_config.modules)
        names = []
        for key in source:
            module, _, suffix = key.rpartition(".")
            if module in self.modules:
                if suffix == "u":
                    names.append(f"{module}.weight")
                elif suffix != "v":
                    names.append(key)
            else:
                names.append(key)
        self._names = names

    def __getitem__(self, key: str) -> Any:
        module, _, suffix = key.rpartition(".")
        if module in self.modules and suffix == "weight":
            u = read_block(self.source[f"{module}.u"], slice(None))
            v = read_block(self.source[f"{module}.v"], slice(None))
            return (u.double() @ v.double()).to(u.dtype)
        return self.source[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def load_stage(
    model: nn.Module,
    source: Mapping[str, Any],
    arch: ModelArch,
    rank_config: RankConfig,
    *,
    layer_offset: int,
    num_local_layers: int,
) -> None:
    """Load this stage's parameters from ``source`` (Hugging Face names).

    Args:
        model: an empty (``to_empty``) ``GPTModel`` stage.
        layer_offset, num_local_layers: which global layers this pipeline stage holds.
    Raises:
        ValueError: a tensor that fits no parameter of the model, a parameter left empty, or
            one holding non-finite values (a corrupted file that no manifest vouched for).
    """
    params = dict(model.named_parameters())
    loaders = _loaders(model, arch)
    names = NameMap(arch, rank_config)
    filled: dict[str, set] = {}
    origin: dict[str, list[str]] = {}  # our parameter → the Hugging Face tensors it was read from
    aliases = {}
    if arch.tied_embeddings and "output_layer.weight" in params and "lm_head.weight" not in source:
        aliases["output_layer.weight"] = embedding_name(arch)
    for hf_name in source:
        target = names.target(hf_name)
        if target is None:
            continue
        local = target.name
        if target.layer is not None:
            if not layer_offset <= target.layer < layer_offset + num_local_layers:
                continue
            local = local.replace(f"layers.{target.layer}.", f"layers.{target.layer - layer_offset}.", 1)
        _load_one(params, loaders, local, source[hf_name], target.shard, hf_name, filled)
        origin.setdefault(local, []).append(hf_name)
    for ours, hf_name in aliases.items():
        _load_one(params, loaders, ours, source[hf_name], None, hf_name, filled)
        origin.setdefault(ours, []).append(hf_name)
    missing = [n for n in params if len(filled.get(n, ())) < loaders[n][1]]
    if missing:
        raise ValueError(
            f"checkpoint leaves {len(missing)} parameter(s) of this stage empty, e.g. {missing[:3]}; "
            "it does not match the model config or its rank_config.json"
        )
    for name, param in params.items():
        if not torch.isfinite(param).all():
            raise ValueError(
                f"tensor {' or '.join(map(repr, origin.get(name, [name])))} holds NaN or infinite "
                "values; the checkpoint"
                " is corrupted — re-create or re-download it"
            )


def _load_one(
    params: Mapping[str, nn.Parameter],
    loaders: Mapping[str, tuple[Loader, int]],
    local: str,
    tensor: Any,
    shard: Any,
    hf_name: str,
    filled: dict,
) -> None:
    param = params.get(local)
    if param is None:
        if local.startswith(("embedding.", "output_layer.", "decoder.final_layernorm.")):
            return  # held by another pipeline stage (or tied to the embedding)
        raise ValueError(f"checkpoint tensor '{hf_name}' has no place in the model (expected {local})")
    with torch.no_grad():
        loaders[local][0](param, tensor, shard)
    filled.setdefault(local, set()).add(shard)
