"""All-reduce as all-gather + sum (``parallel.exchange``, chosen by ``parallel.collectives``
across nodes) against gloo.

One launch of four real ranks: two-rank groups give exactly gloo's bits for every dtype and
shape the layers use (a sum of two is one addition either way); the four-rank group's
all-gather is exactly gloo's, its all-reduce gives the same bits on every rank, within three
roundings of the exact (float64) sum, and exactly gloo's for integers and above ``LARGE_BYTES``
(where gloo's ring carries it); a tiny model's logits at TP=4 match gloo's in every layout.
``install`` chooses it for a group with one rank per node, and hierarchical collectives cross
the nodes by it — node keys planted per rank emulate the nodes. In two spawned ranks: a peer that exits
ends the next all-reduce with one line naming the group's global ranks.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
from typing import Any

import pytest
import torch

from deinfer_megatron.parallel import exchange
from tests.helpers.distributed import run_ranks
from tests.parallel.test_shm import DTYPES, SHAPES, _equal_to_gloo, _logits_both_ways, _value


def _four_ranks(group: Any) -> dict[str, Any]:
    """Gather + sum against gloo over a group of four ranks."""
    import torch.distributed as dist

    ex = exchange.GatherSum(group)
    wrong, spread, differs = [], [], []
    for d, dtype in enumerate(DTYPES):
        for s, shape in enumerate(SHAPES):
            x = _value(dist.get_rank(group), shape, dtype, seed=10 * d + s).contiguous()
            mine, ref = x.clone(), x.clone()
            ex.all_reduce(mine)
            dist.all_reduce(ref, group=group)
            every = [torch.empty_like(mine) for _ in range(4)]
            dist.all_gather(every, mine, group=group)
            if not all(torch.equal(e, every[0]) for e in every):
                differs.append(f"{dtype} {shape}")
            exact = not dtype.is_floating_point or x.numel() * x.element_size() > exchange.LARGE_BYTES
            if exact and not torch.equal(mine, ref):
                wrong.append(f"all-reduce {dtype} {shape}")
            if not exact:  # within the rounding of three additions of the exact sum (float64)
                xs = [torch.empty_like(x, dtype=torch.float64) for _ in range(4)]
                dist.all_gather(xs, x.double(), group=group)
                bound = 3 * torch.finfo(dtype).eps * torch.stack(xs).abs().sum(0)
                spread.append(((mine.double() - torch.stack(xs).sum(0)).abs() / bound).max().item())
            out, out_ref = torch.empty(4 * shape[0], *shape[1:], dtype=dtype), torch.empty(4 * shape[0], *shape[1:], dtype=dtype)
            ex.all_gather(out, x)
            dist.all_gather_into_tensor(out_ref, x, group=group)
            if not torch.equal(out, out_ref):
                wrong.append(f"all-gather {dtype} {shape}")
    return {"wrong": wrong, "differs_between_ranks": differs, "error_over_bound": max(spread)}


def _logits_at_tp4(groups: Any) -> dict[str, float]:
    """Max |gather-sum − gloo| of a tiny decomposed llama's logits, per layout."""
    ex = exchange.GatherSum(groups.pg_collection.tp)
    return _logits_both_ways(groups, ex)


def _installed_by_node(tp_group: Any, node_of_rank: dict[int, str]) -> dict[str, Any]:
    """``install`` with planted node keys: its kind, and its all-reduce against gloo."""
    import torch.distributed as dist

    from deinfer_megatron.parallel import collectives, comm
    from deinfer_megatron.parallel.topology import TPView

    real = collectives.node_key
    collectives.node_key = lambda: node_of_rank[dist.get_rank()]
    try:
        installed = collectives.install(tp_group, collectives.Collectives.AUTO, timeout_s=60)
    finally:
        collectives.node_key = real
    transport = comm._TRANSPORTS.get(tp_group)
    cross = type(getattr(transport, "cross", None)).__name__
    x = _value(dist.get_rank(), (2, 3, 5), torch.float32, seed=7)
    tp = TPView.of(tp_group)
    mine, gathered = comm.all_reduce_sum(x.clone(), tp, site="t", layer=0), comm.all_gather_last_dim(x, tp, site="t", layer=0)
    collectives.uninstall(installed)
    ref, ref_gathered = x.clone(), comm.all_gather_last_dim(x, tp, site="t", layer=0)
    dist.all_reduce(ref, group=tp_group)
    return {"kind": installed.kind, "transport": type(transport).__name__, "cross": cross,
            "reduce_diff": (mine - ref).abs().max().item(), "gather_equal": torch.equal(gathered, ref_gathered)}


def _worker() -> dict[str, Any]:
    import torch.distributed as dist

    from deinfer_megatron.parallel import collectives
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.parallel.topology import TPView

    groups = init_parallel(4, 1)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
        pair = pairs[dist.get_rank() // 2]
        tp_group = groups.pg_collection.tp
        collectives.uninstall(groups.transport)  # gloo underneath, shared memory out of the way
        out = {"wrong_pair": _equal_to_gloo(TPView.of(pair), exchange.GatherSum(pair)),
               "four": _four_ranks(tp_group), "logits": _logits_at_tp4(groups)}
        out["one_per_node"] = _installed_by_node(tp_group, {r: f"node{r}" for r in range(4)})
        out["two_per_node"] = _installed_by_node(tp_group, {r: f"node{r // 2}" for r in range(4)})
        return out
    finally:
        shutdown()


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(4, _worker, timeout=600)


def test_two_ranks_exchange_exactly_gloos_bits_for_every_dtype_and_shape(results) -> None:
    for r in results:
        assert r["wrong_pair"] == []


def test_four_ranks_gather_exactly_and_reduce_to_the_same_bits_everywhere(results) -> None:
    for r in results:
        assert r["four"]["wrong"] == [] and r["four"]["differs_between_ranks"] == []
        assert r["four"]["error_over_bound"] <= 1.0  # a sum taken in another order than gloo's


def test_logits_with_gather_sums_match_gloos_at_tp4(results) -> None:
    for r in results:
        assert set(r["logits"]) == {"deinfer", "naive", "dense"}
        assert max(r["logits"].values()) < 1e-5, r["logits"]


def test_one_rank_per_node_gathers_and_sums_and_hierarchical_crosses_nodes_so(results) -> None:
    for r in results:
        one, two = r["one_per_node"], r["two_per_node"]
        assert (one["kind"], one["transport"]) == ("gather-sum", "GatherSum")
        assert (two["kind"], two["transport"], two["cross"]) == ("hierarchical", "Hierarchical", "GatherSum")
        for case in (one, two):
            assert case["reduce_diff"] < 1e-5 and case["gather_equal"]


# ------------------------------------------------------------------ a peer that exits


def _rank(rank: int, store: str, answers: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    ex = exchange.GatherSum(dist.group.WORLD)
    x = torch.ones(1000)
    ex.all_reduce(x)  # both ranks are up and connected
    if rank == 1:
        os._exit(0)
    try:
        for _ in range(3):
            ex.all_reduce(x)
        answers.put("no error")
    except RuntimeError as err:
        answers.put(str(err))


def test_a_peer_that_exits_is_named_in_one_line(tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    answers = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), answers)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        message = answers.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert message.startswith("tensor-parallel all-reduce across nodes (global ranks [0, 1]) failed ("), message
    assert "\n" not in message
