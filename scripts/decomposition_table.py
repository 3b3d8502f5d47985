#!/usr/bin/env python
"""Perplexity of SmolLM2-135M decompositions, each row produced by the project's own commands
(printed as they run).

Two tables:

    .venv/bin/python scripts/decomposition_table.py [--ratios 0.9 0.8 0.6] [--out docs/decomposition_table.md]

dense vs svd / asvd / svd-llm × uniform / variadic at several ratios; calibration: Pride and
Prejudice, evaluation: Emma (both from ../shared/data/text/austen).

    .venv/bin/python scripts/decomposition_table.py --held-out [--configs 0.8:variadic:none ...] \\
        [--work DIR] [--out docs/decomposition_table.md]

svd-llm at each ``ratio:allocation:update``, calibrated on conversations the dense model writes
itself (what ``--calib-self 16`` generates, written once to ``DIR/self_written.txt`` and given
as ``--calib-text``, so the runs do not sample it again), measured on the two texts docs/HEALING.md holds out of calibration and healing: *Northanger
Abbey* (the held-out novel) and the evaluation half of the standard library's documentation
(``pydoc_data.topics`` split as ``tests/helpers/text.py`` splits it: the held-out technical
prose; the Jargon File is healing data, so it is not held out), the dense model on the same
windows.
Each row records the decomposition's wall and CPU seconds (the machine may be shared: CPU time
divided by the threads used approximates the wall time on idle cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers.text import real_text

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "text"
AUSTEN = TEXT / "austen"
CLI = [sys.executable, "-m", "deinfer_megatron.cli.main"]
STDLIB_EVAL_CHARS = 200_000  # of the evaluation half's ~230k; eval-ppl reads its first --eval-tokens


def run(args: list[str]) -> str:
    print("$ deinfer-megatron " + " ".join(args), flush=True)
    return subprocess.run(CLI + args, check=True, capture_output=True, text=True).stdout.strip()


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def methods_table(a: argparse.Namespace) -> list[str]:
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
    return lines


def self_written(model: Path, path: Path, n: int, seq_len: int) -> None:
    """The conversations ``decompose --calib-self n`` would sample (seed 0), as text."""
    import transformers

    from deinfer_megatron.decompose.calibration import self_dialogues

    if path.is_file():
        return
    print(f"writing {n} self-written conversations of {seq_len} tokens to {path}", flush=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype="float32").eval()
    ids = self_dialogues(hf, tokenizer, n=n, seq_len=seq_len, seed=0)
    path.write_text(tokenizer.decode(ids.reshape(-1)), encoding="utf-8")


def held_out_texts(work: Path) -> dict[str, Path]:
    """The held-out novel and technical prose of docs/HEALING.md (the prose as a file in ``work``)."""
    prose = work / "stdlib_eval.txt"
    prose.write_text(real_text(STDLIB_EVAL_CHARS, "evaluation"), encoding="utf-8")
    return {"novel": AUSTEN / "northangerabbey.txt", "prose": prose}


def held_out_table(a: argparse.Namespace) -> list[str]:
    work = a.work or Path(tempfile.mkdtemp(prefix="decomposition-table-"))
    work.mkdir(parents=True, exist_ok=True)
    model = Path(run(["fetch-model", "smollm2-135m"]).splitlines()[-1])
    calib = work / "self_written.txt"
    self_written(model, calib, a.calib_self, 256)
    texts = held_out_texts(work)

    def ppl(folder: Path) -> dict[str, float]:
        return {name: json.loads(run(["eval-ppl", "--model", str(folder), "--text", str(text), "--max-tokens",
                                      str(a.eval_tokens), "--window", "512", "--layout", "deinfer", "--json"]))["ppl"]
                for name, text in texts.items()}

    dense = ppl(model)
    today = datetime.date.today().isoformat()
    lines = ["| ratio | allocation | update | novel ppl (× dense) | prose ppl (× dense) | decompose wall s / CPU s | date |",
             "|---|---|---|---|---|---|---|",
             f"| dense | - | - | {dense['novel']:.2f} (1.00) | {dense['prose']:.2f} (1.00) | - | {today} |"]
    commands = []
    for spec in a.configs:
        ratio, allocation, update = spec.split(":")
        out = work / f"svd-llm-{ratio}-{allocation}-{update}"
        args = ["decompose", "--model", str(model), "--method", "svd-llm", "--ratio", ratio, "--allocation", allocation,
                "--update", update, "--calib-text", str(calib), "--calib-tokens", str(a.calib_self * 256),
                "--out", str(out), "--overwrite"]
        start, cpu = time.time(), children_cpu()
        run(args)
        took, cpu_took = time.time() - start, children_cpu() - cpu
        got = ppl(out)
        row = (f"| {ratio} | {allocation} | {update} | {got['novel']:.2f} ({got['novel'] / dense['novel']:.2f}) "
               f"| {got['prose']:.2f} ({got['prose'] / dense['prose']:.2f}) | {took:.0f} / {cpu_took:.0f} | {today} |")
        print("  → " + row, flush=True)
        lines.append(row)
        commands.append("deinfer-megatron " + " ".join(args))
    return lines + ["", "Commands (then `eval-ppl --model OUT --text TEXT --max-tokens "
                    f"{a.eval_tokens} --window 512 --layout deinfer --json` on each held-out text):", ""] + [
        f"    {c}" for c in commands]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ratios", type=float, nargs="+", default=[0.9, 0.8, 0.6])
    p.add_argument("--methods", nargs="+", default=["svd", "asvd", "svd-llm"])
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--held-out", action="store_true", help="the svd-llm options on held-out novel and prose")
    p.add_argument("--configs", nargs="+", default=[f"{r}:{alloc}:{upd}" for r in ("0.8", "0.6")
                                                     for alloc in ("variadic", "fisher") for upd in ("none", "sequential")],
                   help="ratio:allocation:update of each --held-out row")
    p.add_argument("--calib-self", type=int, default=16, help="--held-out: self-written conversations (of 256 tokens)")
    p.add_argument("--work", type=Path, help="--held-out: folder for the calibration text and the decompositions")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "decomposition_table.md")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    heading = SECTIONS[1] if a.held_out else SECTIONS[0]
    lines = held_out_table(a) if a.held_out else methods_table(a)
    print("\n".join(lines))
    write_section(a.out, heading, lines)


SECTIONS = ("## Methods and ratios (calibration: Pride and Prejudice; evaluation: Emma)",
            "## svd-llm options on held-out texts (calibration: self-written conversations)")


def write_section(path: Path, heading: str, lines: list[str]) -> None:
    """Replace this table's section of ``path`` (the other table's stays), through a temporary
    file and a rename."""
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    parts = {h: "" for h in SECTIONS}
    current = None
    for line in old.splitlines(keepends=True):
        if line.rstrip("\n") in SECTIONS:
            current = line.rstrip("\n")
        elif current is not None:
            parts[current] += line
    parts[heading] = "\n" + "\n".join(lines) + "\n\n"
    text = "".join(f"{h}\n{parts[h]}" for h in SECTIONS if parts[h].strip())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text.rstrip("\n") + "\n", encoding="utf-8")
    tmp.replace(path)


if __name__ == "__main__":
    main()
