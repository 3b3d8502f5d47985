"""launch.allocator: large temporaries reused from the heap instead of mapped and zero-filled at
every use — counted in page faults against the formula (one per 4 KiB page of a fresh mapping),
in fresh interpreters since the setting is per process and decided once."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from deinfer_megatron.launch import allocator

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the allocator setting is glibc's (mallopt)")

BLOCK = 64 << 20  # above glibc's 32 MiB ceiling for its own threshold: mapped afresh by default
PAGE = os.sysconf("SC_PAGE_SIZE")
WARMUP, CALLS = 20, 10  # glibc's aligned allocations settle into reusing the freed block within ~13 calls

# Configure as a rank does, then time nothing: count the minor faults of each of CALLS passes that
# allocate one BLOCK-sized temporary and free it again (after WARMUP such passes, as in a decode loop),
# and report the median pass: one pass that the kernel or glibc happens to hand a fresh mapping (seen
# once in CI: 1 of 10) must not decide the test, while a setting that maps every block faults them all.
PROBE = f"""
import json, resource, torch
from deinfer_megatron.launch import allocator
state = allocator.configure()
x = torch.ones({BLOCK // 4})
def step():
    (x * 2.0).sum()
for _ in range({WARMUP}):
    step()
per_call = []
for _ in range({CALLS}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    per_call.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
faults = sorted(per_call)[{CALLS} // 2]
print(json.dumps({{"state": state, "faults": faults, "per_call": per_call}}))
"""


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in (allocator.ENV, "LD_PRELOAD", *allocator._GLIBC_VARIABLES)}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, "OMP_NUM_THREADS": "1", **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_large_blocks_are_reused_unless_the_user_chose_otherwise() -> None:
    pages = BLOCK / PAGE
    kept = _probe()
    assert kept["state"] == f"keep mmap>{allocator.MMAP_THRESHOLD} trim>{allocator.TRIM_THRESHOLD}"
    assert kept["faults"] < 0.1 * pages, kept  # the freed block is handed out again, already mapped
    system = _probe(**{allocator.ENV: "system"})
    assert system["state"] == "system"
    assert system["faults"] > 0.9 * pages, system  # a fresh mapping: every page faulted in again
    # glibc's own variable is the user's choice and is not overridden (here: map everything above 64 KiB)
    user = _probe(MALLOC_MMAP_THRESHOLD_="65536")
    assert user["state"] == "glibc MALLOC_MMAP_THRESHOLD_=65536"
    assert user["faults"] > 0.9 * pages, user


def test_a_bad_setting_is_one_line_naming_the_variable(monkeypatch, capsys) -> None:
    from deinfer_megatron.cli.main import run

    monkeypatch.setattr(allocator, "_state", None)
    monkeypatch.setenv(allocator.ENV, "never")
    assert run(["plan", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "DEINFER_MEGATRON_MALLOC='never' is not one of keep, system" in err and "/nonexistent" not in err
