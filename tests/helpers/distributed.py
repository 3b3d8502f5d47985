"""Run a check function on N real gloo ranks (one spawned process each).

One launch per world size runs many checks, because starting ranks costs seconds. This is the
project's own local launcher; a failing rank fails the test with its traceback.
"""

from __future__ import annotations

from typing import Any, Callable

from deinfer_megatron.launch.local import spawn_local


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 900) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` ranks; return each rank's result, by rank."""
    return spawn_local(world, fn, *args, timeout=timeout)
