"""What the server says about itself while ``loadgen`` drives it: its ``/metrics`` read before,
during (every ``POLL_S``) and after the run.

From the difference of the counters: the steps it ran, the tokens they fed (decoding and
prompt), where rank 0's model loop spent them (``serving.stats``: idle, schedule, exchange,
forward, complete), the CPU seconds of its model-loop and HTTP threads, and its prefix-cache
hit rate; from the polls, the most sequences it ran at once and the largest share of its KV
memory in use. A server that does not export a metric (an older one) leaves it out.
"""

from __future__ import annotations

import asyncio
from typing import Any

POLL_S = 0.25
PHASES = ("idle", "schedule", "exchange", "forward", "complete")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → ``{"name{labels}": value}`` (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


class MetricsPoller:
    """Reads ``url``'s ``/metrics`` (the ``…/v1`` base's host) until stopped; keeps the first and
    last reading and the peaks of the gauges that change during a run."""

    def __init__(self, client: Any, base_url: str, headers: dict[str, str]) -> None:
        self.client, self.headers = client, headers
        self.url = base_url.rsplit("/v1", 1)[0] + "/metrics"
        self.first: dict[str, float] | None = None
        self.last: dict[str, float] = {}
        self.peaks = {"deinfer_running_sequences": 0.0, "deinfer_kv_cache_usage_ratio": 0.0,
                      "deinfer_queue_length": 0.0}

    async def read(self) -> None:
        try:
            response = await self.client.get(self.url, headers=self.headers)
        except Exception:  # noqa: BLE001 - a failed poll is a missing sample, not a failed run
            return
        if response.status_code != 200:
            return
        values = parse_metrics(response.text)
        if self.first is None:
            self.first = values
        self.last = values
        for name in self.peaks:
            if name in values:
                self.peaks[name] = max(self.peaks[name], values[name])

    async def run(self, stop: asyncio.Event) -> None:
        await self.read()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=POLL_S)
            except asyncio.TimeoutError:
                await self.read()
        await self.read()

    def report(self) -> dict[str, Any]:
        """The run's server-side numbers (module docstring); empty when nothing was read."""
        if self.first is None:
            return {}
        before, after = self.first, self.last

        def delta(name: str) -> float | None:
            return after[name] - before.get(name, 0.0) if name in after else None

        out: dict[str, Any] = {"peak_running_sequences": self.peaks["deinfer_running_sequences"],
                               "peak_kv_cache_usage_ratio": self.peaks["deinfer_kv_cache_usage_ratio"],
                               "peak_queue_length": self.peaks["deinfer_queue_length"]}
        steps = delta("deinfer_steps_total")
        if steps is not None:
            out["steps"] = steps
            out["decode_tokens"] = delta('deinfer_step_tokens_total{kind="decode"}')
            out["prompt_tokens"] = delta('deinfer_step_tokens_total{kind="prompt"}')
            out["step_phase_s"] = {p: delta(f'deinfer_step_phase_seconds_total{{phase="{p}"}}') for p in PHASES}
            out["thread_cpu_s"] = {t: delta(f'deinfer_thread_cpu_seconds{{thread="{t}"}}')
                                   for t in ("model_loop", "http")}
        queries, hits = delta("deinfer_prefix_cache_queries_total"), delta("deinfer_prefix_cache_hits_total")
        if queries:
            out["prefix_cache_hit_ratio"] = (hits or 0.0) / queries
        return out
