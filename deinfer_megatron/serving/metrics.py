"""The server's Prometheus metrics, in a registry of their own (two servers in one process, as
in tests, never share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deinfer_megatron.serving.blocks import BlockManager
from deinfer_megatron.serving.scheduler import Request
from deinfer_megatron.serving.stats import PHASES, StepStats

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    """Requests by status, tokens in and out, queue / batch / KV blocks, prefix-cache hits, TTFT,
    TPOT, end-to-end."""

    def __init__(self, kv_bytes: int) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("deinfer_requests", "HTTP requests answered, by status", ["status"], registry=r)
        self.prompt_tokens = Counter("deinfer_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.completion_tokens = Counter("deinfer_generation_tokens", "tokens generated", registry=r)
        self.queue = Gauge("deinfer_queue_length", "requests waiting to be admitted", registry=r)
        self.running = Gauge("deinfer_running_sequences", "sequences in the running batch", registry=r)
        self.kv_use = Gauge("deinfer_kv_cache_usage_ratio", "share of KV blocks held or reserved by sequences",
                            registry=r)
        self.kv_blocks = Gauge("deinfer_kv_cache_blocks", "KV blocks in the pool, by state", ["state"], registry=r)
        self.prefix_queries = Counter("deinfer_prefix_cache_queries", "prompt tokens of admitted sequences",
                                      registry=r)
        self.prefix_hits = Counter("deinfer_prefix_cache_hits", "prompt tokens found in the prefix cache",
                                   registry=r)
        self.prefix_rate = Gauge("deinfer_prefix_cache_hit_ratio", "prefix-cache hits / queries (tokens)",
                                 registry=r)
        self.steps = Counter("deinfer_steps", "model steps run", registry=r)
        self.step_tokens = Counter("deinfer_step_tokens", "tokens fed to the model, by kind", ["kind"], registry=r)
        self.step_seconds = Counter("deinfer_step_phase_seconds", "rank 0's model loop, seconds by phase",
                                    ["phase"], registry=r)
        self.thread_cpu = Gauge("deinfer_thread_cpu_seconds", "CPU seconds of rank 0's threads", ["thread"],
                                registry=r)
        self._counted: dict[str, float] = {}
        kv = Gauge("deinfer_kv_cache_bytes", "KV-cache bytes this server's largest rank holds", registry=r)
        kv.set(kv_bytes)
        self.ttft = Histogram("deinfer_time_to_first_token_seconds", "arrival to first token", buckets=_LATENCY,
                              registry=r)
        self.tpot = Histogram("deinfer_time_per_output_token_seconds", "after the first token, per token",
                              buckets=_LATENCY, registry=r)
        self.e2e = Histogram("deinfer_e2e_request_latency_seconds", "arrival to last token", buckets=_LATENCY,
                             registry=r)

    def observe_finished(self, request: Request) -> None:
        self.prompt_tokens.inc(len(request.prompt))
        self.completion_tokens.inc(request.completion_tokens)
        if request.first_token_at is None or request.finished_at is None:
            return
        self.ttft.observe(request.first_token_at - request.arrived)
        self.e2e.observe(request.finished_at - request.arrived)
        per_choice = request.completion_tokens / request.n
        if per_choice > 1:
            self.tpot.observe((request.finished_at - request.first_token_at) / (per_choice - 1))

    def observe_batch(self, queue: int, running: int, pool: BlockManager) -> None:
        self.queue.set(queue)
        self.running.set(running)
        self.kv_use.set(pool.in_use / pool.blocks)
        self.kv_blocks.labels(state="total").set(pool.blocks)
        self.kv_blocks.labels(state="in_use").set(pool.in_use)
        self.kv_blocks.labels(state="cached").set(pool.cached)
        self._count(self.prefix_queries, "queries", pool.queried_tokens)
        self._count(self.prefix_hits, "hits", pool.hit_tokens)
        self.prefix_rate.set(pool.hit_rate)

    def _count(self, counter: Counter, key: str, total: float) -> None:
        """Bring ``counter`` up to ``total`` (kept by the model loop, read at a scrape)."""
        counter.inc(max(0.0, total - self._counted.get(key, 0.0)))
        self._counted[key] = total

    def observe_steps(self, stats: StepStats) -> None:
        self._count(self.steps, "steps", stats.steps)
        self._count(self.step_tokens.labels(kind="decode"), "decode", stats.decode_tokens)
        self._count(self.step_tokens.labels(kind="prompt"), "prompt", stats.prompt_tokens)
        for phase in PHASES:
            self._count(self.step_seconds.labels(phase=phase), phase, stats.seconds[phase])
        for thread, seconds in stats.cpu_seconds().items():
            self.thread_cpu.labels(thread=thread).set(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)
