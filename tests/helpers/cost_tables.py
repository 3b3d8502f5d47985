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


def fake_measure_shapes(dtype: str, needs, *, threads: int) -> dict:
    """A stand-in for ``calibrate.measure_shapes``: a microsecond per weight row per batch row."""
    out: dict = {}
    for gemm, rows in needs:
        out.setdefault(gemm, []).append([float(rows), 1e-6 * rows * gemm.k])
    return out


def fake_measure_attention(dtype: str, cases, *, threads: int) -> dict:
    """A stand-in for ``calibrate.measure_attention``: a nanosecond per cached token per sequence."""
    out: dict = {}
    for attend, batch, context in cases:
        out.setdefault(attend, []).append([float(batch), float(context), 1e-9 * batch * context])
    return out


def free_attention(arch, rank_config, work) -> dict[str, list[list[float]]]:
    """``CostTable.attention`` rows at zero seconds for every attention ``work``'s plan prices."""
    from deinfer_megatron.planning.pricing import required_attention
    from deinfer_megatron.planning.cost_model import attention_cases, attention_key

    out: dict[str, list[list[float]]] = {}
    for a, b, c in attention_cases(work.dtype, required_attention(arch, rank_config, work)):
        out.setdefault(attention_key(work.dtype, a), []).append([float(b), float(c), 0.0])
    return out


def with_free_shapes(table: CostTable, arch, rank_config, *, tp: int, batches, contexts) -> CostTable:
    """``table`` with every matrix product and attention a plan of ``arch`` at these batch sizes
    and contexts (prompt + new tokens, as the command prices them) prices planted at zero
    seconds, so that ``host_table`` finds it complete (a run planted with it measures nothing)
    and only what the table itself prices costs time."""
    from dataclasses import replace

    from deinfer_megatron.planning.pricing import Workload, required_gemms
    from deinfer_megatron.planning.cost_model import shape_key

    shapes, attention = dict(table.shapes), dict(table.attention)
    for b in batches:
        for c in contexts:
            work = Workload(tp=tp, batch=b, context=c)
            for g, m in required_gemms(arch, rank_config, work):
                shapes.setdefault(shape_key("float32", g), []).append([float(m), 0.0])
            for k, rows in free_attention(arch, rank_config, work).items():
                attention.setdefault(k, []).extend(rows)
    return replace(table, shapes={k: sorted(v) for k, v in shapes.items()},
                   attention={k: sorted(v) for k, v in attention.items()})


def favouring(layout: str, arch, rank_config, *, tp: int, batches, contexts) -> CostTable:
    """This host's key (one thread) with a table where only the blocks' fixed framework time
    costs anything, and nothing in ``layout``; every shape and attention a plan at ``batches``
    and ``contexts`` prices planted
    (``with_free_shapes``). Saved under a ``DEINFER_MEGATRON_CACHE`` it makes a real command's
    ``--layout auto`` choose ``layout`` wherever it may, without measuring anything."""
    from deinfer_megatron.planning.cost_model import TableKey

    blocks = {l: {b: (0.0 if l == layout else 1.0) for b in ("attention", "mlp")} for l in ("deinfer", "naive", "dense")}
    table = CostTable(TableKey.current(1), _gemm(FREE), FREE, {"all_reduce": [0.0, FREE], "all_gather": [0.0, FREE]},
                      {str(tp): {"blocks": blocks, "layer": 0.0, "outside": 0.0}})
    return with_free_shapes(table, arch, rank_config, tp=tp, batches=batches, contexts=contexts)
