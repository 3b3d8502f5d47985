"""``DType.native`` agrees with the CPU's own flags, and a job asking for an emulated precision
gets one warning line, once per process however many jobs it checks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from deinfer_megatron.generation.job import GenerateJob, validate
from deinfer_megatron.runtime.options import DType, warn_if_emulated
from tests.helpers.tiny_models import full_rank_folders

CPUINFO = Path("/proc/cpuinfo")


@pytest.mark.skipif(torch.cuda.is_available() or not CPUINFO.is_file(), reason="reads a Linux CPU's flags")
def test_bfloat16_is_native_where_the_cpu_flags_say_so() -> None:
    flags = set()
    for line in CPUINFO.read_text().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    assert DType.BFLOAT16.native == bool(flags & {"avx512_bf16", "amx_bf16"})
    assert DType.FLOAT32.native


def _emulated(monkeypatch, emulated: bool) -> None:
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: not emulated)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    warn_if_emulated.cache_clear()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name.startswith("deinfer_megatron")]


def test_a_job_in_an_emulated_precision_warns_once(tmp_path, monkeypatch, caplog) -> None:
    _, _, dec = full_rank_folders(tmp_path)
    _emulated(monkeypatch, True)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # bench checks one job per cell: still one line
            validate(GenerateJob(Path(dec), ("Hi",), dtype="bfloat16"))
    (line,) = _warnings(caplog)
    assert line.startswith("--dtype bfloat16: this CPU has no bfloat16 instructions") and "--dtype float32" in line
    assert "\n" not in line

    caplog.clear()
    warn_if_emulated.cache_clear()
    with caplog.at_level(logging.WARNING):
        validate(GenerateJob(Path(dec), ("Hi",), dtype="float32"))
    assert _warnings(caplog) == []


def test_no_warning_where_bfloat16_is_native(monkeypatch, caplog) -> None:
    _emulated(monkeypatch, False)
    with caplog.at_level(logging.WARNING):
        warn_if_emulated(DType.BFLOAT16)
    assert DType.BFLOAT16.native and _warnings(caplog) == []


@pytest.mark.parametrize("rank, lines", [(0, 1), (1, 0)])
def test_under_a_launcher_only_rank_0_warns(monkeypatch, caplog, rank: int, lines: int) -> None:
    """Every rank a launcher starts runs the command: the job's warning comes from rank 0 alone."""
    _emulated(monkeypatch, True)
    for name, value in {"RANK": str(rank), "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "t"}.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING):
        warn_if_emulated(DType.BFLOAT16)
    assert len(_warnings(caplog)) == lines
