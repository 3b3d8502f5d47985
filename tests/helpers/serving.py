"""Start ``deinfer-megatron serve`` as a real process (local ranks) and find its ranks; run the
server's model loop without HTTP on launched ranks (``drive_steps``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from deinfer_megatron.launch.local import free_port

ROOT = Path(__file__).resolve().parents[2]


class Server:
    """A running ``serve`` command; ``url`` is its base (``…/v1``)."""

    def __init__(self, model: Path, *args: str, log: Path, start_timeout: float = 180) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deinfer_megatron.cli.main", "serve", "--model", str(model),
             "--port", str(self.port), *args],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"serve did not come up in {start_timeout:.0f} s: {log.read_text()[-2000:]}")
            time.sleep(0.5)

    def ranks(self) -> list[int]:
        """The pids of the rank processes the command spawned, in start order (rank 0 first)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                pids.append(int(entry.name))
        return sorted(pids)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Driven:
    """What ``drive_steps`` saw: every request's generated ids, and what the steps did."""

    tokens: list[list[int]]
    mixed: bool = False  # a step decoded running sequences and fed prompt tokens
    batched_prefill: bool = False  # a step fed the prompts of two sequences or more
    waited: bool = False  # a request waited while the batch had room: the pool was full
    evicted: bool = False  # a cached block was taken for another sequence
    hit_tokens: int = 0
    queried_tokens: int = 0
    pool_dtypes: frozenset = frozenset()  # of every layer's paged pool


def ids_text(ids: list[int]) -> str:
    """A "tokenizer" whose text is the ids themselves, so the events give the ids back."""
    return "".join(f"{i}," for i in ids)


def drive_steps(stage: Any, prompts: list[list[int]], max_new: list[int], arrive_at: list[int], *,
                kind: str = "full", absorb: bool = True, blocks: int = 64, block_size: int = 4,
                max_running: int = 3, chunk: int = 4, max_seq_len: int = 48, prefix_caching: bool = True,
                sampled: Any = None) -> Driven | None:
    """The server's model loop without HTTP, on every rank of a launched job: request i arrives
    at step ``arrive_at[i]``; rank 0 schedules and sends each plan (``step.exchange_plan``), every
    rank runs it. Returns what rank 0 saw (None on the other ranks)."""
    from deinfer_megatron.generation.sampling import SamplingParams
    from deinfer_megatron.layers.paged_cache import PagedContext
    from deinfer_megatron.serving.blocks import BlockManager
    from deinfer_megatron.serving.scheduler import Request, Scheduler
    from deinfer_megatron.serving.step import StepPlan, StepRunner, exchange_plan

    runner = StepRunner(stage, PagedContext(blocks, block_size, max_seq_len, kv_cache=kind, absorb_values=absorb))
    if stage.groups.global_rank != 0:
        while not (plan := exchange_plan(None, stage.device)).stop:
            runner.run(plan)
        return None
    pool = BlockManager(blocks, block_size, prefix_caching=prefix_caching)
    scheduler = Scheduler(pool=pool, max_running=max_running, max_seq_len=max_seq_len, max_queue=64,
                          decode=ids_text, eos_ids=frozenset(), prefill_chunk=chunk)
    texts = [""] * len(prompts)
    requests = [Request(prompt=list(p), max_tokens=m, sampling=[sampled or SamplingParams()],
                        sink=lambda e, i=i: texts.__setitem__(i, texts[i] + e.text))
                for i, (p, m) in enumerate(zip(prompts, max_new))]
    seen = Driven(tokens=[])
    step = 0
    while step <= max(arrive_at) or not scheduler.idle():
        for i, at in enumerate(arrive_at):
            if at == step:
                scheduler.submit(requests[i])
        cached = pool.cached
        plan = scheduler.next_plan()
        prompt_rows = [r for r in plan.rows if r.prompt]
        seen.mixed |= plan.decoded > 0 and plan.prompt_tokens > 0
        seen.batched_prefill |= len(prompt_rows) >= 2
        seen.waited |= scheduler.queue_length > 0 and scheduler.running < max_running
        exchange_plan(plan, stage.device)
        scheduler.complete(plan, runner.run(plan))
        seen.evicted |= pool.cached < cached and scheduler.running > 0
        step += 1
        assert step < 10_000, "the requests never finished"
    exchange_plan(StepPlan(stop=True), stage.device)
    seen.pool_dtypes = frozenset(str(t.dtype) for cache in runner.context.key_value_memory_dict.values()
                                 for t in (cache.a, cache.b))
    seen.tokens = [[int(t) for t in text.split(",")[:-1]] for text in texts]
    seen.hit_tokens, seen.queried_tokens = pool.hit_tokens, pool.queried_tokens
    return seen
