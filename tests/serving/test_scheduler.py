"""The scheduler alone (no model): admission, the queue bound, cancellation, stop strings and
the streamed deltas — against what the OpenAI API documents, with a scripted model."""

from __future__ import annotations

import pytest

from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.serving.blocks import BlockManager
from deinfer_megatron.serving.scheduler import Draining, Event, QueueFull, Request, Scheduler

BLOCK = 4


def scheduler(slots: int, tokens_per_slot: int, **kwargs) -> Scheduler:
    """``slots`` sequences of ``tokens_per_slot`` tokens, in a pool with just room for them."""
    pool = BlockManager(slots * -(-tokens_per_slot // BLOCK), BLOCK)
    return Scheduler(pool=pool, max_running=slots, max_seq_len=tokens_per_slot, **kwargs)


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def request(prompt: str, max_tokens: int, events: list, *, n: int = 1, stop: tuple[str, ...] = ()) -> Request:
    return Request(prompt=[ord(c) for c in prompt], max_tokens=max_tokens, sampling=[SamplingParams()] * n,
                   sink=events.append, stop=stop)


def run(scheduler: Scheduler, script: dict[int, str], steps: int = 100) -> list:
    """Step the scheduler; sequence ``seq`` draws the characters of ``script[seq]`` in turn."""
    plans, drawn = [], {}
    for _ in range(steps):
        if scheduler.idle():
            break
        plan = scheduler.next_plan()
        plans.append(plan)
        tokens = []
        for seq in plan.sampled:
            k = drawn.get(seq, 0)
            drawn[seq] = k + 1
            tokens.append(ord(script[seq][k]))
        scheduler.complete(plan, tokens)
    return plans


def text_of(events: list[Event], index: int = 0) -> str:
    return "".join(e.text for e in events if e.index == index and e.kind in ("text", "done"))


def test_stop_string_cuts_the_text_and_the_stream_adds_up_to_it() -> None:
    events: list[Event] = []
    s = scheduler(2, 64, max_queue=4, decode=decode, eos_ids=frozenset(), prefill_chunk=2)
    s.submit(request("abcde", 20, events, stop=("XY",)))
    run(s, {0: "hello XY world and more"})
    done = [e for e in events if e.kind == "done"]
    assert [e.finish_reason for e in done] == ["stop"]
    assert text_of(events) == "hello "  # the stop string itself is not returned
    assert all("X" not in e.text for e in events)  # nothing of it was streamed before it completed


def test_max_tokens_eos_and_n() -> None:
    events: list[Event] = []
    s = scheduler(4, 64, max_queue=4, decode=decode, eos_ids=frozenset({ord("$")}))
    s.submit(request("p", 3, events, n=2))
    run(s, {0: "abcdef", 1: "x$yz"})
    reasons = {e.index: e.finish_reason for e in events if e.kind == "done"}
    assert reasons == {0: "length", 1: "stop"}  # the end-of-sequence token is OpenAI's "stop"
    assert text_of(events, 0) == "abc" and text_of(events, 1) == "x"


def test_prefill_is_chunked_and_interleaved_with_decodes() -> None:
    events: list[Event] = []
    s = scheduler(2, 64, max_queue=4, decode=decode, eos_ids=frozenset(), prefill_chunk=4)
    s.submit(request("ab", 8, events))
    first = s.next_plan()
    s.complete(first, [ord("x")])  # the short prompt is in, its first token drawn
    s.submit(request("0123456789", 2, events))  # a long prompt arrives while the first decodes
    plans = run(s, {0: "_yzwvuts", 1: "AB"})
    chunks = [r.tokens for p in plans for r in p.rows if not (r.sample and len(r.tokens) == 1)]
    assert [len(c) for c in chunks] == [4, 4, 2]  # ≤ prefill_chunk tokens per step
    assert all(p.decoded for p in plans[:3]), "the running request decodes while the long prompt is fed"


def test_queue_bound_slots_cancel_and_drain() -> None:
    events: list[Event] = []
    s = scheduler(1, 16, max_queue=1, decode=decode, eos_ids=frozenset())
    with pytest.raises(ValueError, match="exceeds the context of 16"):
        s.submit(request("0123456789", 7, events))
    with pytest.raises(ValueError, match="n = 2 exceeds"):
        s.submit(request("a", 1, events, n=2))
    first, second = request("a", 5, events), request("b", 5, events)
    s.submit(first)
    plan = s.next_plan()  # admitted: the queue is empty again
    assert s.running == 1 and s.pool.in_use == 2 and s.queue_length == 0  # 1 + 5 tokens: 2 blocks
    s.complete(plan, [ord("x")])
    s.submit(second)  # waits: the one slot is taken
    with pytest.raises(QueueFull):
        s.submit(request("c", 5, events))
    s.cancel(first)
    plan = s.next_plan()  # the cancelled request leaves, the waiting one takes its slot
    assert plan.release == [0], "the cancelled sequence's generator is released"
    assert list(plan.start) == [1] and s.running == 1 and s.pool.in_use == 2
    s.drain()
    with pytest.raises(Draining):
        s.submit(request("d", 1, events))
