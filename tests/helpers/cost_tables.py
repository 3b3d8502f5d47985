"""Cost tables injected into ``--layout auto`` so that its choice is known in advance: each
prices one thing only, so the fastest layout of a block is the one with the fewest parameters
per rank, or the fewest collective elements per token, computed by the tests from the shapes."""

from __future__ import annotations

from deinfer_megatron.planning.cost_model import CostTable, TableKey

FREE = 1e30  # a rate so high that what it prices costs nothing
KEY = TableKey("test-host", "test", "test", 1)


def _gemm(rate: float) -> dict[str, list[list[float]]]:
    return {d: [[m, e, rate] for m in (1.0, 64.0) for e in (1e3, 1e7)] for d in ("float32", "bfloat16")}


def params_only() -> CostTable:
    """Only weights cost time (a GEMM at a fixed rate): the fewest parameters per rank win."""
    return CostTable(KEY, _gemm(1e9), FREE, {"all_reduce": [0.0, FREE], "all_gather": [0.0, FREE]})


def elements_only() -> CostTable:
    """Only collective bytes cost time: the fewest elements per token win."""
    return CostTable(KEY, _gemm(FREE), FREE, {"all_reduce": [0.0, 1e6], "all_gather": [0.0, 1e6]})


def zero_overhead(tp: int) -> dict[str, dict]:
    """An overhead entry of zeros for TP ``tp``: a table that says framework time costs nothing
    (and that ``host_table`` takes as complete, measuring nothing more)."""
    blocks = {l: {"attention": 0.0, "mlp": 0.0} for l in ("deinfer", "naive", "dense")}
    return {str(tp): {"blocks": blocks, "layer": 0.0, "outside": 0.0}}


def latency_only(latency: float, overhead: dict[str, dict]) -> CostTable:
    """Only each collective's latency and the given fixed overheads cost time."""
    return CostTable(KEY, _gemm(FREE), FREE, {"all_reduce": [latency, FREE], "all_gather": [latency, FREE]},
                     overhead)
