"""Megatron dist-checkpointing for the factor modules: which slice of which *global* tensor
each local parameter holds.

A checkpoint must load at any TP×PP size and under any layout, so its global tensors do not
depend on either. Each section of each factor is saved as its own global tensor, in checkpoint
orientation, under ``<parameter key>.section<s>``:

* a down factor's section ``s``: ``V_s`` (r_s × in);
* an up factor's section ``s``: ``U_s`` (out × r_s), and its bias ``b_s`` (out,).

Locally the modules hold ``Vᵀ``/``Uᵀ`` input-major, merged V rows zero-padded to a multiple of
TP (``GatheredDown``), so a local parameter may span several sections and hold padding. The
split rules live in one place — each module's own ``weight_loader`` — and are read from there:
the loader is run once on a global tensor of element ids (``_local_index``), which says for
every global element where it sits locally (or that this rank does not hold it). Each parameter
becomes one Megatron ``ShardedTensorFactory`` (as Megatron does for its gated fc1): its build
function cuts one ``ShardedTensor`` per section out of the parameter, its merge function puts
the loaded sections back (padding zero). Regions need not be even: the tensors use Megatron's
irregular grid (``axis_fragmentations=None``), which PyTorch's DCP checks.

Replicas (a replicated ``U``, its bias, KV heads repeated when there are fewer than TP ranks)
are saved once: the lowest TP rank holding a region is its main replica. Per-layer ranks differ,
so layers cannot be stacked on one axis: the factors refuse Megatron's stacked-layer offsets
and ask for ``non_homogeneous_layers`` (per-layer keys) instead.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from deinfer_megatron.parallel.topology import TPView

SECTION = ".section"  # global tensor of section s: f"{parameter key}{SECTION}{s}"
STACKED_LAYERS_ERROR = (
    "decomposed layers have per-layer ranks, so their checkpoint tensors cannot be stacked over "
    "layers; build the sharded state dict with metadata={'non_homogeneous_layers': True} "
    "(Megatron-LM: --hetereogenous-dist-checkpoint)"
)


def section_key(param_key: str, section: int) -> str:
    """The global key of one section of a factor parameter."""
    return f"{param_key}{SECTION}{section}"


def _global_shape(module: Any, pname: str, shard_id: int) -> tuple[int, ...]:
    if pname == "bias":
        return (module.output_size,)
    return tuple(module._source_shape(shard_id))


def _local_index(module: Any, pname: str, param: torch.Tensor) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor] | None]:
    """Per section: ``(global offset, region shape, local flat indices)`` of the rectangular
    region of the section's global tensor this rank holds (indices in the region's row-major
    order), or None when it holds none of it.

    The module's own loader is run on a tensor of ids ``1..n`` (float64: exact), into a
    scratch parameter filled with -1; what lands where is the split rule, padding included.
    Costs one float64 copy of each section's global tensor while a state dict is built (at save
    and load time, never in a forward pass).
    """
    loader, sections = module.loader_for(pname)
    out = []
    for s in range(sections):
        shape = _global_shape(module, pname, s)
        numel = int(torch.Size(shape).numel())
        ids = torch.arange(1, numel + 1, dtype=torch.float64).reshape(shape)
        scratch = torch.full(param.shape, -1.0, dtype=torch.float64)
        loader(scratch, ids, s)
        flat = scratch.reshape(-1)
        where = torch.nonzero(flat > 0).reshape(-1)
        if where.numel() == 0:
            out.append(None)
            continue
        gid = flat[where].long() - 1
        order = torch.argsort(gid)
        gid, where = gid[order], where[order]
        coords = torch.stack(torch.unravel_index(gid, shape), dim=-1)
        lo, hi = coords.min(0).values, coords.max(0).values + 1
        region = tuple(int(h - l) for l, h in zip(lo, hi))
        assert int(torch.Size(region).numel()) == gid.numel(), \
            f"{module.prefix}: {pname} of section {s} is not a rectangle of its global tensor"
        out.append((tuple(int(v) for v in lo), region, where))
    return out


def _replica(module: Any, pname: str) -> int:
    """How many lower TP ranks hold the same region (0: this rank is the main replica).

    Down factors split rows or input columns without repetition. Up factors repeat their rows
    on ranks with the same ``output_rows`` (replicated units, a replicated U), and their
    weight also needs the same columns; a bias depends on the rows alone."""
    if not hasattr(module, "output_span"):
        return 0
    tp: TPView = module.tp
    cls = type(module)

    def same(j: int) -> bool:
        other = TPView(j, tp.size)
        if cls.output_rows(module.output_size, module.unit_size, other) != module.output_span:
            return False
        return pname == "bias" or all(cls._columns(r, other) == c
                                      for r, c in zip(module.section_ranks, module.column_spans))

    return sum(1 for j in range(tp.rank) if same(j))


def _dp_replica(metadata: Mapping[str, Any] | None) -> int:
    group = (metadata or {}).get("dp_cp_group")
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _factory(module: Any, pname: str, param: nn.Parameter, key: str, replica_id: tuple[int, ...]) -> Any:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    index = _local_index(module, pname, param)
    held = [(s, entry) for s, entry in enumerate(index) if entry is not None]
    if not held:  # all padding: load (not save) a row of section 0, so the factory is not empty
        shape = _global_shape(module, pname, 0)
        held = [(0, (tuple(0 for _ in shape), (1, *shape[1:]), None))]
    local_shape = tuple(param.shape)

    # ``data`` is the parameter, or an optimizer state of its shape (Megatron builds those with
    # the same factory): pieces take its dtype and device.
    def build(key: str, data: torch.Tensor, replica: Any, flattened_range: Any) -> dict[int, Any]:
        out = {}
        for s, (offset, region, where) in held:
            if where is None:  # a non-main replica: loaded, never saved
                piece = torch.zeros(region, dtype=data.dtype, device=data.device)
                rep = (replica[0], 1 + module.tp.rank, *replica[2:])
            else:
                piece, rep = data.detach().reshape(-1)[where.to(data.device)].reshape(region), replica
            out[s] = ShardedTensor(section_key(key, s), piece, data.dtype, region, _global_shape(module, pname, s),
                                   offset, None, rep)
        return out

    def merge(loaded: Mapping[int, torch.Tensor]) -> torch.Tensor:
        first = next(iter(loaded.values()))
        result = torch.zeros(local_shape, dtype=first.dtype, device=first.device)
        flat = result.view(-1)
        for s, (_, _, where) in held:
            if where is not None:
                flat[where.to(first.device)] = loaded[s].reshape(-1)
        return result

    return ShardedTensorFactory(key, param, build, merge, replica_id)


def factor_sharded_state_dict(module: nn.Module, prefix: str = "", sharded_offsets: tuple = (),
                              metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``sharded_state_dict`` of one factor module (``layers.factors``): a factory per
    parameter, keyed by its state-dict key, building a ``ShardedTensor`` per section."""
    if sharded_offsets:
        raise ValueError(f"{module.prefix}: {STACKED_LAYERS_ERROR}")
    out = {}
    for pname, param in module.named_parameters(recurse=False):
        replica = (0, _replica(module, pname), _dp_replica(metadata))
        out[f"{prefix}{pname}"] = _factory(module, pname, param, f"{prefix}{pname}", replica)
    return out


def children_sharded_state_dict(module: nn.Module, prefix: str = "", sharded_offsets: tuple = (),
                                metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``sharded_state_dict`` of a module that only holds other modules (a ``FactoredLinear``,
    the decomposed attention): its children's, under their names. A child with state but no
    ``sharded_state_dict`` would be saved wrongly, so it is refused."""
    assert not any(True for _ in module.named_parameters(recurse=False)), \
        f"{type(module).__name__} holds parameters of its own; give it a sharded_state_dict"
    out: dict[str, Any] = {}
    for name, child in module.named_children():
        if hasattr(child, "sharded_state_dict"):
            out.update(child.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        else:
            assert not any(True for _ in child.state_dict()), \
                f"{prefix}{name} ({type(child).__name__}) has state but no sharded_state_dict"
    return out
