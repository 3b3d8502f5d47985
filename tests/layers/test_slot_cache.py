"""The slot cache alone: each row writes at its own positions of its own slot and reads its whole
slot, and a step's positions and mask follow from its rows (the model-level check — requests
joining at any step equal generation alone — is tests/serving/test_step.py)."""

from __future__ import annotations

import pytest
import torch

from deinfer_megatron.layers.slot_cache import SlotContext, SlotKVCache


def test_rows_write_their_own_slots_and_positions() -> None:
    context = SlotContext(4, 10)
    cache = SlotKVCache(context, ((2,), (3,)), torch.float32, "cpu")
    context.begin_step([3, 1], [5, 2], 2, torch.device("cpu"))
    assert context.positions.tolist() == [[5, 2], [6, 3]] and context.end == 7
    # masked[row, 0, i, j] is True where key j lies past row's query i
    want = torch.tensor([[[j > 5 + i for j in range(7)] for i in range(2)],
                         [[j > 2 + i for j in range(7)] for i in range(2)]]).unsqueeze(1)
    assert torch.equal(context.masked, want)
    a = torch.arange(8, dtype=torch.float32).view(2, 2, 2)
    b = torch.arange(12, dtype=torch.float32).view(2, 2, 3)
    read_a, read_b = cache.store_and_read(a, b, context.positions, context.slots_of_rows, context.end)
    assert read_a.shape == (7, 2, 2) and read_b.shape == (7, 2, 3)
    assert torch.equal(cache.a[5:7, 3], a[:, 0]) and torch.equal(cache.a[2:4, 1], a[:, 1])
    assert torch.equal(cache.b[5:7, 3], b[:, 0]) and torch.equal(cache.b[2:4, 1], b[:, 1])
    assert cache.a[:, [0, 2]].abs().sum() == 0, "other slots are untouched"
    assert torch.equal(read_a[:, 0], cache.a[:7, 3])
    assert cache.nbytes == (10 * 4 * 2 + 10 * 4 * 3) * 4


def test_a_step_is_refused_when_rows_collide_or_overflow() -> None:
    context = SlotContext(2, 8)
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="share a slot"):
        context.begin_step([1, 1], [0, 0], 1, cpu)
    with pytest.raises(RuntimeError, match="slot out of range"):
        context.begin_step([2], [0], 1, cpu)
    with pytest.raises(RuntimeError, match="past the 8 tokens"):
        context.begin_step([0], [6], 3, cpu)
