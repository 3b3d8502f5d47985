"""The named collectives of ``parallel.comm`` on two real gloo ranks, against what each rank
had (concatenated, summed, sent), and the ledger's records of them; plus their single-process
behaviour (a group of one communicates nothing; a view without a group refuses)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deinfer_megatron.parallel import comm
from deinfer_megatron.parallel.topology import TPView
from tests.helpers.distributed import run_ranks

SHAPE = (2, 3, 4)  # [s, b, c]: 6 tokens of 4 elements


def local_tensor(rank: int) -> torch.Tensor:
    """What rank ``rank`` holds: distinct per rank, so order and sums show."""
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(10 + rank))


def weights(rank: int, width: int) -> torch.Tensor:
    """A rank-specific linear loss ``(y * W_rank).sum()`` makes each rank's gradient differ."""
    return torch.randn(SHAPE[0], SHAPE[1], width, generator=torch.Generator().manual_seed(50 + rank))


def _backward_checks(tp: TPView) -> tuple[dict[str, torch.Tensor], list]:
    """Gradients of each collective's input under rank-specific or common linear losses."""
    c = SHAPE[-1]
    out = {}
    with comm.recording() as ledger:
        x = local_tensor(tp.rank).requires_grad_()
        (comm.all_gather_last_dim(x, tp, site="g", layer=1) * weights(tp.rank, 2 * c)).sum().backward()
        out["gather_reduce_scatter"] = x.grad
        x = local_tensor(tp.rank).requires_grad_()
        (comm.all_gather_last_dim(x, tp, site="g", layer=1, grad="split") * weights(9, 2 * c)).sum().backward()
        out["gather_split"] = x.grad
        x = local_tensor(tp.rank).requires_grad_()
        (comm.copy_to_tp(x, tp, site="c", layer=2) * weights(tp.rank, c)).sum().backward()
        out["copy"] = x.grad
        x = local_tensor(tp.rank).requires_grad_()
        (comm.all_reduce_sum(x, tp, site="r", layer=2) * weights(9, c)).sum().backward()
        out["reduce"] = x.grad
        w = torch.zeros(3, requires_grad=True)
        same_slot = comm.sum_weight_grad_over_tp(w, tp, lambda g: g, lambda f: f, site="w", layer=3)
        (same_slot * torch.tensor([1.0, 2.0, 3.0]) * (tp.rank + 1)).sum().backward()
        out["weight"] = w.grad
    return out, [(r.kind, r.site, r.elements_per_token, r.tokens, r.phase) for r in ledger.records]


def _comm_worker() -> dict[str, Any]:
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown

    groups = init_parallel(2, 1)
    try:
        tp = TPView.of(groups.pg_collection.tp)
        x = local_tensor(tp.rank)
        with comm.recording() as ledger:
            gathered = comm.all_gather_last_dim(x, tp, site="3.qkv_down", layer=3)
            reduced = comm.all_reduce_sum(x.clone(), tp, site="4.proj.down", layer=4)
            comm.all_reduce_sum(x[0].clone(), tp, site="4.proj.up", layer=4)  # [b, c]: 3 tokens
        if groups.global_rank == 0:
            comm.send_to(x * 2, dst=1)
            received = None
        else:
            received = comm.recv_from(SHAPE, x.dtype, x.device, src=0)
        broadcast = comm.broadcast_from(x.clone(), src=1, group=tp.group)
        largest = comm.max_over_world(torch.tensor([float(tp.rank), -float(tp.rank)]))
        comm.barrier(tp)
        grads, backward = _backward_checks(tp)
        return {"grads": grads, "backward": backward,"rank": tp.rank, "gathered": gathered, "reduced": reduced, "received": received,
                "broadcast": broadcast, "largest": largest, "records": list(ledger.records),
                "by_layer": {k: len(v) for k, v in ledger.by_layer().items()},
                "kinds": dict(ledger.kinds(4)), "elements": ledger.elements_per_token(4)}
    finally:
        shutdown()


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(2, _comm_worker)


def test_all_gather_concatenates_in_rank_order(results) -> None:
    expected = torch.cat([local_tensor(0), local_tensor(1)], dim=-1)
    for r in results:
        torch.testing.assert_close(r["gathered"], expected, rtol=0, atol=0)


def test_all_reduce_sums_what_every_rank_had(results) -> None:
    expected = local_tensor(0) + local_tensor(1)
    for r in results:
        torch.testing.assert_close(r["reduced"], expected)


def test_ledger_records_kind_site_elements_and_tokens(results) -> None:
    expected = [
        comm.CommRecord("all_gather", "3.qkv_down", 3, elements_per_token=8, tokens=6),
        comm.CommRecord("all_reduce", "4.proj.down", 4, elements_per_token=4, tokens=6),
        comm.CommRecord("all_reduce", "4.proj.up", 4, elements_per_token=4, tokens=3),
    ]
    for r in results:
        assert r["records"] == expected, r["rank"]
        assert r["by_layer"] == {3: 1, 4: 2}
        assert r["kinds"] == {"all_reduce": 2} and r["elements"] == 8


def test_point_to_point_and_broadcast(results) -> None:
    assert results[0]["received"] is None
    torch.testing.assert_close(results[1]["received"], local_tensor(0) * 2, rtol=0, atol=0)
    for r in results:
        torch.testing.assert_close(r["broadcast"], local_tensor(1), rtol=0, atol=0)
        assert r["largest"].tolist() == [1.0, 0.0]


def test_a_group_of_one_communicates_nothing_and_records_nothing() -> None:
    x = local_tensor(0)
    with comm.recording() as ledger:
        assert comm.all_gather_last_dim(x, TPView(0, 1), site="a", layer=1) is x
        assert comm.all_reduce_sum(x, TPView(0, 1), site="b", layer=1) is x
    assert ledger.records == []


def test_a_view_without_a_group_refuses_to_communicate() -> None:
    with pytest.raises(RuntimeError, match="site.x: all-reduce over 2 .* needs a process group"):
        comm.all_reduce_sum(local_tensor(0), TPView(1, 2), site="site.x", layer=1)
    with pytest.raises(RuntimeError, match="all-gather over 2"):
        comm.all_gather_last_dim(local_tensor(0), TPView(0, 2), site="site.y", layer=1)


def test_each_backward_is_the_adjoint_of_its_collective(results) -> None:
    """The gradients a linear loss gives, written out: all-gather → the sum over ranks of each
    rank's gradient slice (reduce-scatter) or this rank's slice of the common one (split);
    copy → the sum of every rank's gradient; all-reduce → the common gradient itself; a
    replicated weight → the sum of its replicas' gradients."""
    c = SHAPE[-1]
    total = weights(0, 2 * c) + weights(1, 2 * c)
    for r in results:
        k = r["rank"]
        g = r["grads"]
        torch.testing.assert_close(g["gather_reduce_scatter"], total[..., k * c:(k + 1) * c])
        torch.testing.assert_close(g["gather_split"], weights(9, 2 * c)[..., k * c:(k + 1) * c])
        torch.testing.assert_close(g["copy"], weights(0, c) + weights(1, c))
        torch.testing.assert_close(g["reduce"], weights(9, c))
        torch.testing.assert_close(g["weight"], torch.tensor([3.0, 6.0, 9.0]))


def test_backward_collectives_are_recorded_apart_from_the_forward(results) -> None:
    for r in results:
        assert r["backward"] == [
            ("all_gather", "g", 8, 6, "forward"), ("reduce_scatter", "g", 8, 6, "backward"),
            ("all_gather", "g", 8, 6, "forward"),  # split: no collective
            ("all_reduce", "c", 4, 6, "backward"),  # copy: none forward
            ("all_reduce", "r", 4, 6, "forward"),  # its backward is the identity
            ("all_reduce", "w", 3, 1, "weight_grad"),
        ]


def test_without_autograd_nothing_backward_is_set_up() -> None:
    x = local_tensor(0).requires_grad_()
    with torch.no_grad():
        assert comm.copy_to_tp(x, TPView(0, 2), site="c", layer=1) is x
    frozen = local_tensor(0)
    assert comm.copy_to_tp(frozen, TPView(0, 2), site="c", layer=1) is frozen
    with pytest.raises(ValueError, match="grad must be 'reduce_scatter' or 'split'"):
        comm.all_gather_last_dim(frozen, TPView(0, 2), site="g", layer=1, grad="sum")
