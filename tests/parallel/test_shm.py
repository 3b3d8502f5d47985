"""Shared-memory collectives (``parallel.shm``, chosen by ``parallel.collectives``) against gloo.

On two real ranks: every dtype and shape the layers use — odd sizes, and tensors larger than a
slot so that they go through in uneven chunks — gives exactly gloo's result (a 2-rank sum is
one addition either way, so the bits agree); a tiny model's logits at TP=2 are the same with
shared memory and with gloo, in every layout. In one process with a spawned peer: a peer killed
inside a collective, or one that never arrives, ends the wait with a one-line error naming it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from typing import Any

import pytest
import torch

from deinfer_megatron.parallel import collectives, shm
from deinfer_megatron.parallel.collectives import Collectives, GroupShape
from deinfer_megatron.specs.layout import Layout
from tests.helpers.distributed import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
SHAPES = ((1, 1, 1), (1, 3, 7), (5, 2, 33), (1, 1, 70001))  # [s, b, width]: decode, prefill, wide
SMALL_SLOT = 192  # bytes: forces chunks (with a shorter last one) on all but the smallest shapes
pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory collectives need x86-64 Linux")


def _value(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(*shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


def _equal_to_gloo(tp: Any, transport: Any) -> list[str]:
    """Names of the cases where ``transport`` and gloo disagree (exact comparison)."""
    import torch.distributed as dist

    from deinfer_megatron.parallel import comm

    wrong = []
    for d, dtype in enumerate(DTYPES):
        for s, shape in enumerate(SHAPES):
            x = _value(tp.rank, shape, dtype, seed=10 * d + s)
            comm.use_transport(tp.group, transport)
            reduced = comm.all_reduce_sum(x.clone(), tp, site="t", layer=0)
            gathered = comm.all_gather_last_dim(x, tp, site="t", layer=0)
            comm.use_transport(tp.group, None)
            ref = x.clone()
            dist.all_reduce(ref, group=tp.group)
            ref_gather = comm.all_gather_last_dim(x, tp, site="t", layer=0)
            if not torch.equal(reduced, ref):
                wrong.append(f"all-reduce {dtype} {shape}")
            if not torch.equal(gathered, ref_gather):
                wrong.append(f"all-gather {dtype} {shape}")
    return wrong


def _logits_both_ways(groups: Any, transport: Any) -> dict[str, float]:
    """Max |shm − gloo| of a tiny decomposed llama's logits, per layout."""
    from deinfer_megatron.arch.model import arch_from_hf_config
    from deinfer_megatron.models.build import build_stage, load_weights
    from deinfer_megatron.models.pipeline import stage_forward
    from deinfer_megatron.parallel import comm
    from deinfer_megatron.specs.rank_config import RankConfig
    from tests.helpers.tiny_models import decompose_randomly, mixed_ranks, random_hf_model

    hf = random_hf_model("llama")
    ranks = mixed_ranks(hf, [0, 2, 3])
    state = decompose_randomly(hf, ranks)
    arch = arch_from_hf_config(hf.config.to_dict())
    rank_config = RankConfig.from_mapping(ranks, arch)
    ids = torch.randint(0, arch.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(11).unsqueeze(0).expand(2, -1)
    tp_group = groups.pg_collection.tp
    out = {}
    for layout in ("deinfer", "naive", "dense"):
        stage = build_stage(arch, rank_config, Layout(layout), groups)
        load_weights(stage, state, rank_config)
        logits = {}
        for name, t in (("shm", transport), ("gloo", None)):
            comm.use_transport(tp_group, t)
            with torch.no_grad():
                logits[name] = stage_forward(stage, ids, pos)
        comm.use_transport(tp_group, transport)
        out[layout] = (logits["shm"] - logits["gloo"]).abs().max().item()
    return out


def _worker() -> dict[str, Any]:
    import torch.distributed as dist

    from deinfer_megatron.parallel import comm
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.parallel.topology import TPView

    groups = init_parallel(2, 1)  # the default: shared memory between these two local ranks
    try:
        tp = TPView.of(groups.pg_collection.tp)
        default = comm._TRANSPORTS[tp.group]
        segment_left = groups.transport.segment.path.exists()
        names = [shm.new_segment_name()]
        dist.broadcast_object_list(names, src=0)
        small = shm.ShmCollectives(names[0], tp.rank, 2, create=tp.rank == 0, slot_bytes=SMALL_SLOT, timeout_s=60)
        dist.barrier()
        if tp.rank == 0:
            small.unlink()
        out = {"kind": groups.transport.kind, "segment_left": segment_left,
               "wrong_default": _equal_to_gloo(tp, default), "wrong_small_slots": _equal_to_gloo(tp, small),
               "logits": _logits_both_ways(groups, default)}
        small.close()
        return out
    finally:
        shutdown()


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(2, _worker, timeout=600)


def test_local_ranks_use_shared_memory_and_leave_no_segment(results) -> None:
    for r in results:
        assert r["kind"] == "shared-memory"
        assert not r["segment_left"], "the segment's name must be removed once every rank mapped it"


def test_results_equal_gloo_for_every_dtype_and_shape(results) -> None:
    for r in results:
        assert r["wrong_default"] == [] and r["wrong_small_slots"] == []


def test_logits_with_shared_memory_equal_those_with_gloo_at_tp2(results) -> None:
    for r in results:
        assert r["logits"] == {"deinfer": 0.0, "naive": 0.0, "dense": 0.0}


# ------------------------------------------------------------------ a peer that dies or never comes


def _peer(name: str, calls: int, then: str) -> None:
    """Member 1: ``calls`` all-reduces, then either keep calling (to be killed inside one) or sleep."""
    seg = shm.ShmCollectives(name, 1, 2, create=False, timeout_s=30)
    x = torch.ones(4)
    for _ in range(calls):
        seg.all_reduce(x)
    if then == "sleep":
        time.sleep(60)
    while True:
        seg.all_reduce(x)


def _with_peer(then: str, timeout_s: float) -> tuple[Any, shm.ShmCollectives]:
    name = shm.new_segment_name()
    proc = multiprocessing.get_context("spawn").Process(target=_peer, args=(name, 3, then), daemon=True)
    proc.start()
    seg = shm.ShmCollectives(name, 0, 2, create=True, timeout_s=timeout_s, join_timeout_s=60,
                             names=["tensor-parallel rank 0", "tensor-parallel rank 1"])
    seg.unlink()
    x = torch.ones(4)
    for _ in range(3):
        seg.all_reduce(x)
    assert x.tolist() == [8.0] * 4  # 1 → 2 → 4 → 8: the peer really took part
    return proc, seg


def test_a_peer_killed_inside_a_collective_is_named_in_one_line() -> None:
    proc, seg = _with_peer("continue", timeout_s=120)
    try:
        time.sleep(0.3)  # the peer waits inside its fourth all-reduce
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        started = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            for _ in range(2):  # the peer may have published its fourth call before it was killed
                seg.all_reduce(torch.ones(4))
        assert time.monotonic() - started < 5, "a dead peer must be noticed in milliseconds, not at the timeout"
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"shared-memory all-reduce: tensor-parallel rank 1 (pid {proc.pid}) died")
    finally:
        seg.close()
        if proc.is_alive():
            proc.kill()


def test_a_peer_that_never_arrives_times_out_with_its_name() -> None:
    proc, seg = _with_peer("sleep", timeout_s=0.5)
    try:
        with pytest.raises(RuntimeError, match=r"^shared-memory all-gather: tensor-parallel rank 1 \(pid \d+\) "
                                               r"did not arrive within 0.5 s"):
            seg.all_gather(torch.empty(8), torch.ones(4))
    finally:
        seg.close()
        proc.kill()
        proc.join()


def test_a_segment_left_by_a_dead_creator_is_removed_and_a_failed_setup_leaves_none() -> None:
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = shm.SHM_DIR / f"deinfer-tp-{dead.pid}-0123456789ab"
    stale.write_bytes(b"left by a killed job")
    mine = shm.SHM_DIR / f"deinfer-tp-{os.getpid()}-live"  # a live creator's segment stays
    mine.write_bytes(b"")
    try:
        name = shm.new_segment_name()
        with pytest.raises(RuntimeError, match=r"member 1 did not join within 0.2 s"):
            shm.ShmCollectives(name, 0, 2, create=True, timeout_s=0.2)
        assert not stale.exists() and mine.exists()
        assert not (shm.SHM_DIR / name).exists()
    finally:
        stale.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)


# ------------------------------------------------------------------ choosing the transport


def test_group_shapes_by_node() -> None:
    assert GroupShape.of(["a", "a"]) == GroupShape(nodes=1, local=2)
    assert GroupShape.of(["a", "a", "b", "b"]) == GroupShape(nodes=2, local=2)
    assert GroupShape.of(["a", "b"]) == GroupShape(nodes=2, local=1)
    assert GroupShape.of(["a", "b", "a", "b"]) is None  # interleaved: a hierarchy would reorder
    assert GroupShape.of(["a", "a", "a", "b"]) is None  # unequal blocks


def test_collectives_option_is_parsed_with_a_clear_error() -> None:
    assert Collectives.parse("process-group") is Collectives.PROCESS_GROUP
    with pytest.raises(ValueError, match="unknown collectives 'nccl'; choose one of auto, process-group"):
        Collectives.parse("nccl")
    assert collectives.node_key().count("|") == 2
