"""The healing data order: sources take turns, each epoch of a source visits every window once,
and the order is a function of the seed alone."""

from __future__ import annotations

import torch

from deinfer_megatron.healing.data import HealData


def test_sources_take_turns_and_every_window_is_seen_once_per_epoch() -> None:
    big = torch.arange(10 * 4).view(10, 4)  # source 0: window i holds 4i..4i+3
    small = 1000 + torch.arange(3 * 4).view(3, 4)  # source 1: three windows
    data = HealData([big, small])
    rows = torch.cat([data.batch(step, 4, seed=7) for step in range(15)])  # 60 windows
    from_small = rows[:, 0] >= 1000
    assert from_small.tolist() == [False, True] * 30
    firsts_small = rows[from_small][:, 0].tolist()
    for epoch in range(10):  # 30 visits of a 3-window source: 10 epochs, each a permutation
        assert sorted(firsts_small[3 * epoch:3 * epoch + 3]) == [1000, 1004, 1008]
    firsts_big = rows[~from_small][:, 0].tolist()
    assert sorted(firsts_big[:10]) == list(range(0, 40, 4)) and sorted(firsts_big[10:20]) == list(range(0, 40, 4))
    again = torch.cat([data.batch(step, 4, seed=7) for step in range(15)])
    assert torch.equal(rows, again)
    assert not torch.equal(rows, torch.cat([data.batch(step, 4, seed=8) for step in range(15)]))
