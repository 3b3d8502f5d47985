"""This host's cost table: the cached one when its key matches, else measured (seconds) and cached.

A job asks for the table it will price (``host_table``): ``tp`` > 1 needs the collectives, every
TP size its framework overhead (``planning.overhead``, measured once per TP size on ``tp`` local
ranks), every matrix product shape and attention case of the job its time (``with_shapes``,
``with_attention``, measured by ``planning.calibrate``). What is measured is added to the
cache, so each is measured once per host. A measurement that cannot finish is one
``CalibrationFailed`` line, and nothing is cached.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable

from deinfer_megatron.layers.costs import Attend, Gemm
from deinfer_megatron.planning import calibrate, overhead
from deinfer_megatron.planning.cost_model import (
    CostTable,
    TableKey,
    attention_cases,
    attention_key,
    cache_path,
    load_cached,
    save,
    shape_key,
)

log = logging.getLogger(__name__)
# Measurements that failed in this process, by (cache file, TP size): a job prices auto more than
# once (a launched job's rank 0 before and after its groups exist, every bench cell), and a
# measurement that could not finish is not tried again within the process (nor cached on disk).
_FAILED: dict[tuple[Path, int], "CalibrationFailed"] = {}


def with_shapes(table: CostTable, dtype: str, needs: Iterable[tuple[Gemm, int]]) -> CostTable:
    """``table`` with every (shape, rows) of ``needs`` measured (only those it lacks)."""
    missing = table.missing_shapes(dtype, needs)
    if not missing:
        return table
    measured = calibrate.measure_shapes(dtype, missing, threads=table.key.threads)
    return replace(table, shapes=_merged(table.shapes, measured, lambda gemm: shape_key(dtype, gemm)))


def with_attention(table: CostTable, dtype: str, needs: Iterable[tuple[Attend, int, int]]) -> CostTable:
    """``table`` with every (attend, batch, context) of ``needs`` timed (only those it lacks)."""
    missing = table.missing_attention(dtype, needs)
    if not missing:
        return table
    measured = calibrate.measure_attention(dtype, missing, threads=table.key.threads)
    return replace(table, attention=_merged(table.attention, measured, lambda attend: attention_key(dtype, attend)))


def _merged(have: dict[str, list[list[float]]], measured: dict[Any, list[list[float]]],
            key_of: Callable[[Any], str]) -> dict[str, list[list[float]]]:
    """``have`` (a table's rows by key) with each measured case's rows added under its key, sorted."""
    out = {k: list(v) for k, v in have.items()}
    for case, rows in measured.items():
        key = key_of(case)
        out[key] = sorted(out.get(key, []) + rows)
    return out


def host_table(*, tp: int, threads: int | None = None, root: Path | None = None,
               gemms: Iterable[tuple[Gemm, int]] = (), attention: Iterable[tuple[Attend, int, int]] = (),
               dtype: str = "float32") -> CostTable:
    """This host's table: the cached one if its key matches, else a fresh calibration (seconds),
    cached for the next job. ``tp`` > 1 needs the collectives measured too, every TP size its
    framework overhead (``planning.overhead``, measured once per TP size on ``tp`` local ranks),
    every (shape, batch rows) of ``gemms`` in ``dtype`` its time (``with_shapes``) and every
    (attend, batch, context) of ``attention`` its time (``with_attention``)."""
    key = TableKey.current(threads)
    path = cache_path(key, root)
    table = load_cached(path, key)
    gemms, attention = list(gemms), list(attention)
    if (table is not None and (tp == 1 or table.collectives) and str(tp) in table.overhead
            and not table.missing_shapes(dtype, gemms) and not table.missing_attention(dtype, attention)):
        return table
    if (path, tp) in _FAILED:
        raise _FAILED[(path, tp)]
    what = ", ".join(_to_measure(table, tp, dtype, gemms, attention))
    log.info("measuring this machine's cost table once (%s; up to tens of seconds), cached in %s", what, path)
    try:
        if table is None or (tp > 1 and not table.collectives):
            table = calibrate.calibrate(key, collectives=tp > 1)
        if str(tp) not in table.overhead:
            table = with_shapes(table, "float32", overhead.required_gemms(tp))  # what its fit prices
            table = with_attention(table, "float32", overhead.required_attention(tp))
            table = replace(table, overhead={**table.overhead, str(tp): overhead.measure_overhead(table, tp)})
        table = with_attention(with_shapes(table, dtype, gemms), dtype, attention)
    except Exception as err:  # noqa: BLE001 - whatever stopped the measurement, the caller decides
        first = (str(err).strip().splitlines() or [""])[0]
        failed = _FAILED[(path, tp)] = CalibrationFailed(f"could not measure this machine's cost table ({what}): "
                                                         f"{type(err).__name__}: {first}")
        raise failed from err
    save(table, path)
    return table


class CalibrationFailed(RuntimeError):
    """``host_table`` could not measure what it lacks (no shared memory for the collectives, a
    measuring rank that failed or timed out): one line naming what was measured and why it
    stopped. Nothing is cached on disk, so the next job measures again; within one process the
    same measurement is not tried again (``_FAILED``): the same object comes back, and
    ``warned`` says whether its warning was given."""

    warned = False


def _to_measure(table: CostTable | None, tp: int, dtype: str, gemms: list[tuple[Gemm, int]],
                attention: list[tuple[Attend, int, int]]) -> list[str]:
    """What ``host_table`` is about to measure, as the user reads it: the one line said before
    the pause, where the command would otherwise sit silent through a calibration."""
    parts = []
    if table is None or (tp > 1 and not table.collectives):
        parts.append("GEMM, memory and collective rates" if tp > 1 else "GEMM and memory rates")
    if table is None or str(tp) not in table.overhead:
        parts.append(f"framework time at TP={tp}")
    shapes = len(set(gemms)) if table is None else len(table.missing_shapes(dtype, gemms))
    if shapes:
        parts.append(f"{shapes} matrix product shape{'s' if shapes != 1 else ''} of this job")
    attends = len(attention_cases(dtype, attention) if table is None else table.missing_attention(dtype, attention))
    if attends:
        parts.append(f"{attends} attention case{'s' if attends != 1 else ''} at this job's context")
    return parts
