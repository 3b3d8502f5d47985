#!/usr/bin/env python
"""Perplexity of SmolLM2-135M decompositions: dense vs svd / asvd / svd-llm × uniform / variadic
at several ratios, each row produced by the project's own commands (printed as they run).

    .venv/bin/python scripts/decomposition_table.py [--ratios 0.9 0.8 0.6] [--out docs/decomposition_table.md]

Calibration: Pride and Prejudice; evaluation: Emma (both from ../shared/data/text/austen).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AUSTEN = ROOT.parent / "shared" / "data" / "text" / "austen"
CLI = [sys.executable, "-m", "deinfer_megatron.cli.main"]


def run(args: list[str]) -> str:
    print("$ deinfer-megatron " + " ".join(args), flush=True)
    return subprocess.run(CLI + args, check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ratios", type=float, nargs="+", default=[0.9, 0.8, 0.6])
    p.add_argument("--methods", nargs="+", default=["svd", "asvd", "svd-llm"])
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "decomposition_table.md")
    a = p.parse_args()
    model = Path(run(["fetch-model", "smollm2-135m"]).splitlines()[-1])
    evaluate = ["--text", str(AUSTEN / "emma.txt"), "--max-tokens", str(a.eval_tokens), "--window", "512", "--json"]
    dense = json.loads(run(["eval-ppl", "--model", str(model), *evaluate]))["ppl"]
    rows = [("dense", "-", "-", dense, 0.0)]
    with tempfile.TemporaryDirectory() as tmp:
        for ratio in a.ratios:
            for method in a.methods:
                for allocation in ("uniform", "variadic"):
                    out = Path(tmp) / f"{method}-{ratio}-{allocation}"
                    start = time.time()
                    run(["decompose", "--model", str(model), "--method", method, "--ratio", str(ratio),
                         "--allocation", allocation, "--calib-text", str(AUSTEN / "prideprejudice.txt"),
                         "--calib-tokens", str(a.calib_tokens), "--out", str(out)])
                    took = time.time() - start
                    ppl = json.loads(run(["eval-ppl", "--model", str(out), *evaluate]))["ppl"]
                    rows.append((method, str(ratio), allocation, ppl, took))
                    print(f"  → {method} {ratio} {allocation}: ppl {ppl:.2f} ({ppl / dense:.2f}× dense)", flush=True)
    lines = [
        "| method | ratio | ranks | perplexity (Emma) | × dense | decompose s |",
        "|---|---|---|---|---|---|",
    ]
    for method, ratio, allocation, ppl, took in rows:
        lines.append(f"| {method} | {ratio} | {allocation} | {ppl:.2f} | {ppl / dense:.2f} | {took:.0f} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
