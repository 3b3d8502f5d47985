"""Which slice each tensor-parallel rank holds, checked against brute force over many sizes."""

from __future__ import annotations

import pytest

from deinfer_megatron.parallel.topology import (
    Span,
    TPView,
    balanced_split,
    padded_chunk,
    unit_split,
    valid_tp_sizes,
)


def spans(fn, tp: int) -> list[Span]:
    return [fn(TPView(k, tp)) for k in range(tp)]


@pytest.mark.parametrize("tp", range(1, 9))
def test_balanced_split_tiles_the_rows_in_rank_order(tp: int) -> None:
    for n in range(0, 40):
        got = spans(lambda view: balanced_split(n, view), tp)
        rows = [i for s in got for i in range(s.start, s.stop)]
        assert rows == list(range(n)), (n, tp)
        sizes = [s.size for s in got]
        assert max(sizes) - min(sizes) <= 1, (n, tp, sizes)
        assert all(s.full == n for s in got)


def test_unit_split_keeps_units_whole_and_tiles_them() -> None:
    for unit_size in (1, 3, 8):
        for tp in range(1, 9):
            for units in range(tp, 20):
                got = spans(lambda view: unit_split(units, unit_size, view), tp)
                rows = [i for s in got for i in range(s.start, s.stop)]
                assert rows == list(range(units * unit_size)), (units, tp)
                assert all(s.start % unit_size == 0 and s.size % unit_size == 0 for s in got)
                counts = [s.size // unit_size for s in got]
                assert max(counts) - min(counts) <= 1, (units, tp, counts)


def test_unit_split_replicates_fewer_units_on_consecutive_ranks() -> None:
    """GQA with fewer KV heads than ranks: each head on tp/units consecutive ranks, one each."""
    d = 4
    for units in (1, 2, 3, 4):
        for tp in range(units + 1, 13):
            if tp % units:
                with pytest.raises(ValueError, match=f"{units} heads cannot be replicated evenly"):
                    unit_split(units, d, TPView(0, tp))
                continue
            got = spans(lambda view: unit_split(units, d, view), tp)
            held = [s.start // d for s in got]
            assert all(s.size == d for s in got)
            assert held == sorted(held) and all(held.count(u) == tp // units for u in range(units))


def _needed_kv_heads(heads: int, kv_heads: int, tp: int) -> list[set[int]] | None:
    """Brute force: the KV heads each rank's even block of query heads reads, or None when
    the query heads do not split evenly."""
    if heads % tp:
        return None
    per_rank, group = heads // tp, heads // kv_heads
    return [{h // group for h in range(r * per_rank, (r + 1) * per_rank)} for r in range(tp)]


def _valid_by_brute_force(heads: int, kv_heads: int, tp: int) -> bool:
    """Every rank needs as many KV heads as the others, and every KV head is needed by as many
    ranks as the others (so storage and work are even)."""
    needed = _needed_kv_heads(heads, kv_heads, tp)
    if needed is None or len({len(s) for s in needed}) != 1:
        return False
    return len({sum(u in s for s in needed) for u in range(kv_heads)}) == 1


def test_valid_tp_sizes_against_brute_force() -> None:
    for heads in range(1, 17):
        for kv_heads in (k for k in range(1, heads + 1) if heads % k == 0):
            expected = [t for t in range(1, 25) if _valid_by_brute_force(heads, kv_heads, t)]
            assert valid_tp_sizes(heads, kv_heads, limit=24) == expected, (heads, kv_heads)


def test_each_rank_holds_the_kv_heads_its_query_heads_read() -> None:
    """At every valid TP size, ``unit_split`` of the KV heads gives each rank exactly the KV
    heads its ``unit_split`` of the query heads needs (GQA grouping h → h // group)."""
    d = 2
    for heads in range(1, 17):
        for kv_heads in (k for k in range(1, heads + 1) if heads % k == 0):
            for tp in valid_tp_sizes(heads, kv_heads, limit=24):
                needed = _needed_kv_heads(heads, kv_heads, tp)
                for r in range(tp):
                    q = unit_split(heads, d, TPView(r, tp))
                    kv = unit_split(kv_heads, d, TPView(r, tp))
                    group = heads // kv_heads
                    assert {h // group for h in range(q.start // d, q.stop // d)} == needed[r]
                    assert set(range(kv.start // d, kv.stop // d)) == needed[r], (heads, kv_heads, tp, r)


def test_padded_chunk_is_the_smallest_even_cover() -> None:
    for n in range(0, 50):
        for size in range(1, 10):
            brute = next(c for c in range(n + 1) if c * size >= n)
            assert padded_chunk(n, size) == brute, (n, size)


def test_tp_view_refuses_a_rank_outside_its_group() -> None:
    with pytest.raises(ValueError, match="rank 2 is outside a group of 2"):
        TPView(2, 2)
    with pytest.raises(ValueError, match="tp_group is required"):
        TPView.of(None)
