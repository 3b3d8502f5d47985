"""The server's Prometheus metrics, in a registry of their own (two servers in one process, as
in tests, never share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deinfer_megatron.serving.scheduler import Request

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    """Requests by status, tokens in and out, queue / batch / KV use, TTFT, TPOT, end-to-end."""

    def __init__(self, kv_bytes: int) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("deinfer_requests", "HTTP requests answered, by status", ["status"], registry=r)
        self.prompt_tokens = Counter("deinfer_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.completion_tokens = Counter("deinfer_generation_tokens", "tokens generated", registry=r)
        self.queue = Gauge("deinfer_queue_length", "requests waiting for a KV slot", registry=r)
        self.running = Gauge("deinfer_running_sequences", "sequences in the running batch", registry=r)
        self.kv_use = Gauge("deinfer_kv_cache_usage_ratio", "share of KV slots in use", registry=r)
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

    def observe_batch(self, queue: int, running: int, slots_in_use: int, slots: int) -> None:
        self.queue.set(queue)
        self.running.set(running)
        self.kv_use.set(slots_in_use / slots)

    def text(self) -> bytes:
        return generate_latest(self.registry)
