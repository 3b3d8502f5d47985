"""What each factor module declares to Megatron's dist-checkpointing, built as "rank k of n" in
one process: the main-replica pieces of all ranks tile every section's full factor exactly once,
in checkpoint orientation (V: r × in, U: out × r, bias: out), with the values of the full
factors loaded; and merging the pieces a rank loads gives back its local parameter (padding
zero). The reference is the full factor itself, indexed directly."""

from __future__ import annotations

import types

import pytest
import torch

from deinfer_megatron.layers.factors import (
    GatheredDown,
    ReducedDown,
    ReducedUp,
    ReplicatedUp,
    ShardedDown,
    ShardedUp,
)
from deinfer_megatron.layers.sharded_state import STACKED_LAYERS_ERROR, section_key
from deinfer_megatron.parallel.topology import TPView, balanced_split

CONFIG = types.SimpleNamespace(params_dtype=torch.float32, perform_initialization=False)
GEN = torch.Generator().manual_seed(0)

# (class, constructor args per rank, the full tensors of each parameter: name → per section)
DOWN_RANKS = (7, 5, 6)  # Σ = 18: padded at TP 4, split unevenly at TP 4 and 5
CASES = {
    "gathered": (GatheredDown, dict(input_size=16, section_ranks=DOWN_RANKS)),
    "sharded_down": (ShardedDown, dict(input_size=16, section_ranks=DOWN_RANKS)),
    "reduced_down": (ReducedDown, dict(input_size=24, section_ranks=(5,))),
    "sharded_up": (ShardedUp, dict(output_size=32, section_ranks=(6, 9), bias=True, unit_size=8)),
    "reduced_up": (ReducedUp, dict(output_size=12, section_ranks=(5, 3), bias=True)),
    "replicated_up": (ReplicatedUp, dict(output_size=12, section_ranks=(5,), bias=True)),
}


def _full(cls, kw) -> dict[str, list[torch.Tensor]]:
    ranks = kw["section_ranks"]
    if "input_size" in kw:
        return {"weight": [torch.randn(r, kw["input_size"], generator=GEN) for r in ranks]}
    out = kw["output_size"]
    return {"weight": [torch.randn(out, r, generator=GEN) for r in ranks],
            "bias": [torch.randn(out, generator=GEN) for _ in ranks]}


def _modules(cls, kw, tp: int, full) -> list:
    mods = []
    for k in range(tp):
        extra = {}
        if cls is ReducedDown:  # the input split a row-parallel V reads (uneven at TP 5)
            extra["input_span"] = balanced_split(kw["input_size"], TPView(k, tp))
        m = cls(**kw, **extra, config=CONFIG, tp_group=TPView(k, tp), prefix="layer")
        for name, sections in full.items():
            loader, _ = m.loader_for(name)
            with torch.no_grad():
                for s, t in enumerate(sections):
                    loader(getattr(m, name), t, s)
        mods.append(m)
    return mods


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pieces_tile_the_full_factors_and_merge_back(case: str, tp: int) -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    cls, kw = CASES[case]
    if cls is ShardedUp and tp not in (1, 2, 4):
        pytest.skip("4 heads split or replicate evenly only at TP 1, 2, 4")
    full = _full(cls, kw)
    covered = {(n, s): torch.zeros(t.shape, dtype=torch.int) for n, ts in full.items() for s, t in enumerate(ts)}
    for m in _modules(cls, kw, tp, full):
        sd = m.sharded_state_dict(prefix="p.")
        assert set(sd) == {f"p.{n}" for n in full}
        for name, factory in sd.items():
            pname = name.removeprefix("p.")
            pieces = factory.build()
            for s, piece in pieces.items():
                assert isinstance(piece, ShardedTensor)
                assert piece.key == section_key(name, s)
                assert piece.global_shape == tuple(full[pname][s].shape)
                region = tuple(slice(o, o + n) for o, n in zip(piece.global_offset, piece.local_shape))
                assert torch.equal(piece.data, full[pname][s][region]), (case, tp, name, s)
                if is_main_replica(piece.replica_id):
                    covered[(pname, s)][region] += 1
            merged = factory.merge_fn({s: p.data.clone() for s, p in pieces.items()})
            assert torch.equal(merged, getattr(m, pname).detach()), (case, tp, name)
    for key, count in covered.items():
        assert torch.all(count == 1), (case, tp, key, count)


def test_padding_only_rank_still_loads_and_merges_zeros() -> None:
    """Σr = 5 over TP 4: chunks of 2, rank 3 holds only padding rows."""
    kw = dict(input_size=8, section_ranks=(2, 3))
    full = _full(GatheredDown, kw)
    m = _modules(GatheredDown, kw, 4, full)[3]
    factory = m.sharded_state_dict()["weight"]
    pieces = factory.build()
    assert all(not p.replica_id == 0 and any(p.replica_id) for p in pieces.values())  # never saved
    assert torch.equal(factory.merge_fn({s: p.data for s, p in pieces.items()}), torch.zeros(8, 2))


def test_stacked_layer_offsets_are_refused() -> None:
    m = GatheredDown(8, (3,), config=CONFIG, tp_group=TPView(0, 1), prefix="decoder.layers.0.qkv_down")
    with pytest.raises(ValueError, match="non_homogeneous_layers"):
        m.sharded_state_dict(sharded_offsets=((0, 0, 4),))
    assert "per-layer ranks" in STACKED_LAYERS_ERROR


def test_an_optimizer_state_of_another_dtype_keeps_its_dtype() -> None:
    """Megatron's optimizer checkpoint builds the same factory over a float32 state of a
    bfloat16 parameter: the pieces and the merged tensor are the state's, not the parameter's."""
    config = types.SimpleNamespace(params_dtype=torch.bfloat16, perform_initialization=False)
    m = GatheredDown(8, (3, 4), config=config, tp_group=TPView(0, 2), prefix="layer")  # rows 0-3: no padding
    factory = m.sharded_state_dict()["weight"]
    state = torch.randn(m.weight.shape, generator=GEN)
    factory.data = state
    pieces = factory.build()
    assert {p.dtype for p in pieces.values()} == {torch.float32}
    assert torch.equal(factory.merge_fn({s: p.data for s, p in pieces.items()}), state)
