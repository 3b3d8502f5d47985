"""Where rank 0's model loop spends a step, counted for ``/metrics`` and a periodic log line.

The loop of ``server._Lead`` is five phases: waiting for work (``idle``), the scheduler choosing
the step (``schedule``: admission, block tables), sending the plan to every rank
(``exchange``), the forward with sampling and the tokens' broadcast (``forward``), and turning
the tokens into text and client events (``complete``). ``StepStats`` adds up each phase's
seconds, the steps and their tokens, and the CPU seconds of the loop's thread and of the HTTP
thread (uvicorn: parsing, streaming), read from ``/proc`` where it exists: on a machine with
few cores the HTTP thread competes with the model for them, and this shows how much.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

PHASES = ("idle", "schedule", "exchange", "forward", "complete")
LOG_EVERY_S = 10.0


def thread_cpu_seconds(native_id: int | None) -> float:
    """CPU seconds (user + system) of thread ``native_id`` of this process; 0 where unknown."""
    if native_id is None:
        return 0.0
    try:
        fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class StepStats:
    """Running totals of the model loop (module docstring); ``log_if_due`` writes one line
    every ``LOG_EVERY_S`` seconds with the rates since the last line."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.decode_tokens = 0
        self.prompt_tokens = 0
        self.loop_thread = threading.get_native_id()
        self.http_thread: int | None = None
        self._last_log = time.monotonic()
        self._last = (0, 0, 0, dict(self.seconds))

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def step(self, decode_tokens: int, prompt_tokens: int) -> None:
        self.steps += 1
        self.decode_tokens += decode_tokens
        self.prompt_tokens += prompt_tokens

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds of the model loop's thread and of the HTTP thread so far."""
        return {"model_loop": thread_cpu_seconds(self.loop_thread), "http": thread_cpu_seconds(self.http_thread)}

    def log_if_due(self, running: int, queued: int, blocks_in_use: int, blocks: int, hit_rate: float) -> None:
        now = time.monotonic()
        span = now - self._last_log
        if span < LOG_EVERY_S:
            return
        steps, decoded, prompted, seconds = self._last
        busy = {p: self.seconds[p] - seconds[p] for p in PHASES}
        total = max(1e-9, sum(busy.values()))
        if self.steps > steps:
            log.info("%.1f decode tokens/s, %.1f prompt tokens/s, %.1f steps/s; %d running, %d queued; KV blocks "
                     "%d/%d, prefix-cache hits %.0f%%; step time: %s", (self.decode_tokens - decoded) / span,
                     (self.prompt_tokens - prompted) / span, (self.steps - steps) / span, running, queued,
                     blocks_in_use, blocks, 100 * hit_rate,
                     ", ".join(f"{p} {100 * busy[p] / total:.0f}%" for p in PHASES))
        self._last_log = now
        self._last = (self.steps, self.decode_tokens, self.prompt_tokens, dict(self.seconds))
