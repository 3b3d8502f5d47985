"""``deinfer-megatron demo --layouts`` must pass its own parity check."""

from __future__ import annotations

import subprocess
import sys


def test_demo_compares_the_three_layouts() -> None:
    proc = subprocess.run([sys.executable, "-m", "deinfer_megatron.cli.main", "demo", "--layouts"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "parity OK" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("dense", "naive", "deinfer") and len(line.split()) == 7}
    assert set(rows) == {"dense", "naive", "deinfer"}
    for name, cols in rows.items():
        assert cols[1] == cols[2] and cols[3] == cols[4], f"{name}: measured collectives differ from plan"
