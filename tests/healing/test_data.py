"""The healing data order: sources take turns (equally, or in proportion to their weights), each
epoch of a source visits every window once, and the order is a function of the seed alone."""

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


def test_equal_weights_are_the_plain_turns() -> None:
    windows = [torch.arange(7 * 2).view(7, 2), 100 + torch.arange(5 * 2).view(5, 2),
               200 + torch.arange(2 * 2).view(2, 2)]
    plain, weighted = HealData(windows), HealData(windows, weights=[2.5, 2.5, 2.5])
    for step in range(20):
        assert torch.equal(plain.batch(step, 3, seed=1), weighted.batch(step, 3, seed=1))


def test_weights_set_each_sources_share_in_every_stretch() -> None:
    prose = torch.arange(20 * 2).view(20, 2)  # source 0
    chats = 1000 + torch.arange(4 * 2).view(4, 2)  # source 1
    data = HealData([prose, chats], weights=[1.0, 3.0])
    rows = torch.cat([data.batch(step, 4, seed=3) for step in range(10)])  # 40 windows
    from_chats = (rows[:, 0] >= 1000).view(10, 4)
    assert from_chats.sum(dim=1).tolist() == [3] * 10  # 3 of every 4 consecutive windows, as Σw = 4 says
    firsts = rows[rows[:, 0] >= 1000][:, 0].tolist()  # 30 visits of 4 windows: each epoch a permutation
    for epoch in range(7):
        assert sorted(firsts[4 * epoch:4 * epoch + 4]) == [1000, 1002, 1004, 1006]
    thirds = HealData([prose, chats, chats + 1000], weights=[0.5, 0.2, 0.3])  # shares of a stretch of 10
    sources = [thirds.turn(k)[0] for k in range(1000)]
    for start in range(0, 1000, 10):
        stretch = sources[start:start + 10]
        assert [stretch.count(j) for j in range(3)] == [5, 2, 3]
    asked_late = HealData([prose, chats, chats + 1000], weights=[0.5, 0.2, 0.3])  # a resume asks step n first
    assert [asked_late.turn(k) for k in range(999, -1, -1)] == [thirds.turn(k) for k in range(999, -1, -1)]


def test_the_weights_survive_the_saved_state(tmp_path) -> None:
    """A resume rebuilds the data from ``data.pt`` (healing/job._saved_data): the weights come back
    with the windows, so the resumed run takes the same turns."""
    from deinfer_megatron.healing import state as run_state

    data = HealData([torch.arange(12).view(6, 2), 100 + torch.arange(4).view(2, 2)],
                    [{"text": "a.txt", "weight": 1.0}, {"self_dialogues": 2, "weight": 2.0}], [1.0, 2.0])
    run_state.save_torch(tmp_path / "data.pt", {"windows": data.windows, "sources": data.sources,
                                                 "weights": data.weights})
    again = HealData(**run_state.load_torch(tmp_path / "data.pt"))
    assert again.weights == [1.0, 2.0] and again.sources == data.sources
    for step in (7, 0, 3):
        assert torch.equal(again.batch(step, 3, seed=5), data.batch(step, 3, seed=5))
