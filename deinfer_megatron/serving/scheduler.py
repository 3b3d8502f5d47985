"""Continuous batching on rank 0: which sequences run in the next step, and what came out.

A request (one HTTP call) holds ``n`` sequences. It waits in a bounded queue until its
sequences may run: fewer than ``max_running`` sequences run, and the KV pool can promise each
its worst case, prompt + ``max_tokens`` (``blocks.BlockManager``: what the prefix cache holds
is shared, the rest reserved). A request that could never fit is refused when it arrives; a
full queue refuses more (HTTP 429). Requests are admitted in arrival order.

Every step is one forward (``step``): one token for each running sequence whose prompt is in
the cache, and prompt chunks of the sequences still prefilling, oldest first, up to
``prefill_chunk`` prompt tokens in all — several arriving prompts share a step, and a long one
is cut so that it never stalls the running ones for more than a chunk. A sequence leaves the
batch as soon as it finishes; its blocks go back to the pool (its full ones stay findable by
later prompts) and the next waiting request may be admitted at the next step. A request whose
client went away (``cancel``) is dropped at the next step too.

Text is decoded here, on rank 0 only: each sequence's ids are decoded whole after every token,
and the new text is reported as a delta, holding back what could still turn into a ``stop``
string (and an incomplete UTF-8 character), so the streamed deltas add up to the final text.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.serving.blocks import BlockManager, SeqBlocks, block_keys, blocks_for
from deinfer_megatron.serving.step import Row, StepPlan

DEFAULT_PREFILL_CHUNK = 128  # prompt tokens per step (docs/SERVING.md, "The prompt budget of a step")


class QueueFull(RuntimeError):
    """The wait queue holds ``--max-queue`` requests already (HTTP 429)."""


class Draining(RuntimeError):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclass(frozen=True)
class Event:
    """What a request's client is told: ``kind`` "text" (a delta of choice ``index``), "done"
    (``finish_reason`` and the usage so far) or "error" (``message``)."""

    kind: str
    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    message: str = ""


@dataclass
class Request:
    """One completion call: a prompt continued ``n`` times. ``sink`` receives its ``Event``s
    (from the model loop's thread; it must hand them on, not block)."""

    prompt: list[int]
    max_tokens: int
    sampling: list[SamplingParams]  # one per choice
    sink: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    completion_tokens: int = 0
    cancelled: bool = False
    keys: list[bytes] | None = None  # the prompt's block keys, made once while it waits

    @property
    def n(self) -> int:
        return len(self.sampling)


@dataclass
class Sequence:
    id: int
    request: Request
    index: int
    blocks: SeqBlocks
    computed: int = 0  # positions whose K/V are in the cache
    generated: list[int] = field(default_factory=list)
    text: str = ""  # the decoded text, cut at a stop string
    sent: int = 0  # characters of ``text`` already reported
    finish_reason: str | None = None

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.request.prompt)

    def tokens(self) -> list[int]:
        """Prompt and generated ids: the token at each position."""
        return self.request.prompt + self.generated


class Scheduler:
    """Admission, the running batch, and turning sampled tokens into client events.

    Args:
        pool: the KV pool's blocks (``BlockManager``; the scheduler is its only user).
        max_running: the most sequences running at once (``--max-batch``).
        max_seq_len: the most tokens of one sequence, prompt + ``max_tokens``.
        max_queue: requests that may wait.
        decode: ids → text (the model's tokenizer, special tokens skipped).
        eos_ids: tokens that end a sequence.
        prefill_chunk: the most prompt tokens fed in one step, over all prefilling sequences.
    """

    def __init__(self, *, pool: BlockManager, max_running: int, max_seq_len: int, max_queue: int,
                 decode: Callable[[list[int]], str], eos_ids: frozenset[int],
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
        self.pool, self.max_running, self.max_seq_len, self.max_queue = pool, max_running, max_seq_len, max_queue
        self.decode, self.eos_ids, self.prefill_chunk = decode, eos_ids, prefill_chunk
        self._waiting: deque[Request] = deque()
        self._running: list[Sequence] = []
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._release: list[int] = []
        self.draining = False
        self.finished: list[Request] = []  # for the metrics, taken by ``take_finished``

    # ---------------------------------------------------------------- the HTTP thread's side
    def submit(self, request: Request) -> None:
        """Queue ``request``; ``QueueFull`` / ``Draining`` when it cannot be taken, ValueError
        when it could never run."""
        needed = len(request.prompt) + request.max_tokens
        if needed > self.max_seq_len:
            raise ValueError(f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) = "
                             f"{needed} exceeds the context of {self.max_seq_len} tokens; shorten the "
                             "prompt or lower max_tokens")
        if request.n > self.max_running:
            raise ValueError(f"n = {request.n} exceeds the {self.max_running} sequences the server runs at once")
        pool = self.pool
        if request.n * blocks_for(needed, pool.block_size) > pool.blocks:
            raise ValueError(f"n = {request.n} sequences of {needed} tokens (prompt + max_tokens) need more than "
                             f"the KV pool's {pool.blocks} blocks of {pool.block_size} tokens; lower max_tokens "
                             "or n (or start the server with a larger --kv-budget-gb)")
        with self._lock:
            if self.draining:
                raise Draining("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (--max-queue); retry later")
            self._waiting.append(request)
            self._lock.notify()

    def cancel(self, request: Request) -> None:
        """The client went away: its sequences leave at the next step."""
        with self._lock:
            request.cancelled = True
            self._lock.notify()

    def drain(self) -> None:
        """Refuse new requests and the queued ones; the running ones finish."""
        with self._lock:
            self.draining = True
            while self._waiting:
                self._waiting.popleft().sink(Event("error", message="the server is shutting down"))
            self._lock.notify()

    def fail_all(self, message: str) -> None:
        """End every request with an error (the model loop broke)."""
        with self._lock:
            self.draining = True
            requests = {id(s.request): s.request for s in self._running}
            requests.update({id(r): r for r in self._waiting})
            self._waiting.clear()
            self._running.clear()
        for r in requests.values():
            r.sink(Event("error", message=message))

    # ---------------------------------------------------------------- the model loop's side
    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def idle(self) -> bool:
        """Nothing to run, and (once draining) nothing will come."""
        return not self._running and not self._waiting

    def wait_for_work(self, timeout: float) -> None:
        with self._lock:
            if self.idle():
                self._lock.wait(timeout)

    def _finish(self, seq: Sequence, reason: str | None) -> None:
        self._running.remove(seq)
        self.pool.release(seq.blocks)
        self._release.append(seq.id)
        request = seq.request
        if reason is not None:
            seq.finish_reason = reason
            request.sink(Event("text", seq.index, seq.text[seq.sent :]))
            seq.sent = len(seq.text)
            request.sink(Event("done", seq.index, finish_reason=reason))
        if not any(s.request is request for s in self._running):
            request.finished_at = time.perf_counter()
            self.finished.append(request)

    def _admit(self, request: Request, plan: StepPlan) -> bool:
        """Start ``request``'s sequences if the batch and the pool have room for all of them."""
        if len(self._running) + request.n > self.max_running:
            return False
        if request.keys is None:
            prompt = request.prompt
            request.keys = block_keys(prompt, self.pool.block_size, (len(prompt) - 1) // self.pool.block_size)
        worst = len(request.prompt) + request.max_tokens
        claimed: list[SeqBlocks] = []
        for _ in range(request.n):
            blocks = self.pool.admit(request.keys, len(request.prompt), worst)
            if blocks is None:
                for taken in claimed:
                    self.pool.release(taken)
                return False
            claimed.append(blocks)
        for index, (params, blocks) in enumerate(zip(request.sampling, claimed)):
            seq = Sequence(next(self._ids), request, index, blocks, computed=blocks.cached)
            self._running.append(seq)
            plan.start[seq.id] = params
        return True

    def next_plan(self) -> StepPlan:
        """The next step: drop cancelled sequences, admit waiting requests (in arrival order),
        then one token of every decoding sequence and prompt chunks up to ``prefill_chunk``."""
        plan = StepPlan()
        with self._lock:
            for seq in [s for s in self._running if s.request.cancelled]:
                self._finish(seq, None)
            while self._waiting:
                request = self._waiting[0]
                if not request.cancelled and not self._admit(request, plan):
                    break
                self._waiting.popleft()
        plan.release, self._release = self._release, []
        budget = self.prefill_chunk
        prefills: list[Row] = []
        for seq in self._running:
            if not seq.prefilling:
                self.pool.grow(seq.blocks, seq.computed + 1)
                plan.rows.append(Row(seq.id, seq.computed, (seq.generated[-1],), tuple(seq.blocks.table), True))
            elif budget > 0:
                prompt = seq.request.prompt
                end = min(len(prompt), seq.computed + budget)
                budget -= end - seq.computed
                self.pool.grow(seq.blocks, end)
                prefills.append(Row(seq.id, seq.computed, tuple(prompt[seq.computed : end]),
                                    tuple(seq.blocks.table), end == len(prompt)))
        plan.rows += prefills  # single-token rows first: they attend as one batch
        return plan

    def complete(self, plan: StepPlan, tokens: list[int]) -> None:
        """Apply what ``plan`` produced: ``tokens`` for ``plan.sampled``, in order."""
        by_id = {s.id: s for s in self._running}
        for row in plan.rows:
            seq = by_id.get(row.seq)
            if seq is not None:
                seq.computed = row.start + len(row.tokens)
                self.pool.register(seq.blocks, seq.tokens(), seq.computed)
        now = time.perf_counter()
        for seq_id, token in zip(plan.sampled, tokens):
            seq = by_id[seq_id]
            request = seq.request
            request.first_token_at = request.first_token_at or now
            request.completion_tokens += 1
            seq.generated.append(token)
            reason = self._advance(seq, token)
            if reason is not None:
                with self._lock:
                    self._finish(seq, reason)

    def _advance(self, seq: Sequence, token: int) -> str | None:
        """Decode the new text, report what is safe to report; the finish reason, if any."""
        request = seq.request
        if token in self.eos_ids:
            return "stop"
        text = self.decode(seq.generated)
        for stop in request.stop:
            if stop in text:
                seq.text = text[: text.index(stop)]
                return "stop"
        seq.text = text
        if len(seq.generated) >= request.max_tokens:
            return "length"
        hold = max((len(s) - 1 for s in request.stop), default=0)
        safe = len(text) - hold
        while safe > seq.sent and text[safe - 1] == "\ufffd":  # an incomplete character
            safe -= 1
        if safe > seq.sent:
            request.sink(Event("text", seq.index, text[seq.sent : safe]))
            seq.sent = safe
        return None

    def take_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done
