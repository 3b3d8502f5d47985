#!/usr/bin/env python
"""Is a teacher run in the ranks every step faster than its top-k logits computed once? Measured.

    OMP_NUM_THREADS=2 python scripts/heal_teacher_compare.py --model DEC --teacher DENSE --text FILE \\
        [--k 64] [--tail bucket] [--steps 8] [--skip 2] [--batch 4] [--seq-len 256] [--max-tokens 8192]

``heal --distill logits`` runs the dense teacher in the same ranks on every batch. The
alternative stores, for every training window, the teacher's ``k`` most likely next tokens once
(their log-probabilities, ids and the tail's log-mass: ``8k + 4`` bytes per token instead of
``4 · vocab``) and then runs only the student per step. This script times both at TP=1 in one
process with the project's own pieces (``models.build.load_folder`` for both models,
``training.Trainer`` for the student step, ``healing.loss`` for the losses — what ``heal``
runs, ``healing/megatron_student.py``):

- (a) ``in_ranks``: teacher forward, then the student's forward and backward, KL over the full
  vocabulary (``healing.loss.distill_loss``), the optimizer step;
- (b) ``topk``: the same student step with the KL to the stored top-k
  (``healing.loss.topk_kl``; ``--tail bucket``, the default: the other tokens as one bucket,
  a lower bound of the full KL that equals it at ``k`` = vocabulary; ``renorm``: both
  distributions renormalised over the k tokens);
- the precompute: the teacher over every window (at most ``--max-tokens`` tokens of
  ``--text``) in batches of ``--batch``, top-k taken, kept in memory.

The two step kinds alternate (a, b, a, b, ...) so that a change in the machine's load falls on
both; the first ``--skip`` of each are left out of the medians. Before any step both losses are
computed on the first batch from the same weights (``first_kl_in_ranks``, ``first_kl_topk``).
Prints one JSON object: the medians, the precompute's seconds per token, the bytes per token it
stores, the mean probability the teacher's k tokens carry (``teacher_topk_mass``), and
``break_even_epochs`` = precompute time / time saved per epoch: after that many passes over the
data precomputing has paid (null if the top-k step is not faster). The top-k step reads its
targets from memory; from a disk they would be ``8k + 4`` bytes per token more to read. Writes nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class Settings:
    """The parsed command line (picklable: ``launch.run.run_on_ranks`` hands it to the rank)."""

    model: Path
    teacher: Path
    text: Path
    k: int = 64
    tail: str = "bucket"
    steps: int = 8  # of each kind
    skip: int = 2  # of each kind, left out of the medians
    batch: int = 4
    seq_len: int = 256
    max_tokens: int = 8192
    lr: float = 1e-4
    layout: str = "deinfer"


class OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (unknown flag, bad choice) as one line, like the checks below."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def parse(argv: Sequence[str] | None) -> Settings:
    from deinfer_megatron.healing.loss import TAILS

    p = OneLineParser(prog="heal_teacher_compare.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="decomposed folder (the student)")
    p.add_argument("--teacher", type=Path, required=True, help="the dense folder it was decomposed from")
    p.add_argument("--text", type=Path, required=True, help="text to cut into training windows")
    p.add_argument("--k", type=int, default=64, help="teacher tokens stored per position")
    p.add_argument("--tail", choices=TAILS, default="bucket", help="what the top-k KL does with the other tokens")
    p.add_argument("--steps", type=int, default=8, help="timed steps of each kind")
    p.add_argument("--skip", type=int, default=2, help="first steps of each kind left out of the medians")
    p.add_argument("--batch", type=int, default=4, help="windows per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    p.add_argument("--max-tokens", type=int, default=8192, help="tokens of --text precomputed (the data)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--layout", choices=("deinfer", "naive"), default="deinfer", help="the student's layout")
    a = p.parse_args(argv)
    s = Settings(a.model, a.teacher, a.text, a.k, a.tail, a.steps, a.skip, a.batch, a.seq_len, a.max_tokens,
                 a.lr, a.layout)
    check(s)
    return s


def check(s: Settings) -> None:
    """Every bad input, before a model is built (one ``ValueError`` line each)."""
    from deinfer_megatron.arch.model import load_arch
    from deinfer_megatron.files.text import read_text
    from deinfer_megatron.healing.job import HealJob, check_models

    for flag, value in (("--k", s.k), ("--steps", s.steps), ("--batch", s.batch), ("--seq-len", s.seq_len),
                        ("--max-tokens", s.max_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}")
    if not 0 <= s.skip < s.steps:
        raise ValueError(f"--skip must be at least 0 and less than --steps ({s.steps}), got {s.skip}")
    if not s.lr > 0:
        raise ValueError(f"--lr must be > 0, got {s.lr}")
    check_models(HealJob(model=s.model, teacher=s.teacher, out=Path("unused")))  # folders, arch, tokenizer
    arch = load_arch(s.teacher)
    if s.k > arch.vocab_size:
        raise ValueError(f"--k must be at most the vocabulary ({arch.vocab_size}), got {s.k}")
    if s.seq_len > arch.max_positions:
        raise ValueError(f"--seq-len must be at most the model's context ({arch.max_positions}), got {s.seq_len}")
    read_text(s.text, "--text", max_chars=1000)
    if s.max_tokens < s.seq_len:
        raise ValueError(f"--max-tokens ({s.max_tokens}) must hold at least one --seq-len window ({s.seq_len})")


def _windows(s: Settings) -> torch.Tensor:
    import transformers

    from deinfer_megatron.decompose.calibration import text_windows

    tokenizer = transformers.AutoTokenizer.from_pretrained(s.teacher)
    return text_windows(tokenizer, s.text, seq_len=s.seq_len, max_tokens=s.max_tokens)


def _batches(n: int, batch: int) -> list[torch.Tensor]:
    """The window indices of every step of one epoch: consecutive ``batch``-sized runs, the
    last one wrapped round to the first windows."""
    return [torch.arange(i * batch, (i + 1) * batch) % n for i in range(max(1, -(-n // batch)))]


def measure(s: Settings) -> dict[str, Any]:
    """One rank (TP=1): both models, the precompute, then the two step kinds alternated."""
    from deinfer_megatron.healing.loss import distill_loss, teacher_topk, token_kl, topk_kl
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.models.pipeline import stage_forward
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.specs.layout import Layout
    from deinfer_megatron.training import OptimizerConfig, Trainer

    windows = _windows(s)
    groups = init_parallel(1, 1)
    try:
        student = load_folder(s.model, Layout(s.layout), groups)
        teacher = load_folder(s.teacher, Layout.DENSE, groups)
        total = 2 * s.steps
        trainer = Trainer(student, OptimizerConfig(lr=s.lr, total_steps=total, warmup_steps=0, min_lr=0.1 * s.lr,
                                                   betas=(0.9, 0.95), clip_grad=1.0), train="factors")

        def forward(stage: Any, ids: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return stage_forward(stage, ids, torch.arange(ids.shape[1]).expand_as(ids))

        # the precompute: every window once, in step-sized batches
        t0 = time.perf_counter()
        stored = [teacher_topk(forward(teacher, windows[rows]), s.k) for rows in
                  torch.arange(windows.shape[0]).split(s.batch)]
        precompute_s = time.perf_counter() - t0
        top_logp, top_ids, tail_logp = (torch.cat(parts) for parts in zip(*stored))
        topk_mass = float(top_logp.exp().sum(-1).mean())  # the teacher's probability the k tokens carry
        bytes_per_token = sum(t.element_size() * t[0, 0].numel() for t in (top_logp, top_ids, tail_logp))

        steps = _batches(windows.shape[0], s.batch)
        first = windows[steps[0]]
        logits = forward(student, first)
        first_full = float(token_kl(logits, forward(teacher, first)))
        first_topk = float(topk_kl(logits, top_logp[steps[0]], top_ids[steps[0]], tail_logp[steps[0]], s.tail))

        def full_loss(logits: torch.Tensor, micro: dict[str, torch.Tensor]) -> torch.Tensor:
            return distill_loss(logits, micro["teacher"], micro["input_ids"])[0]

        def stored_loss(logits: torch.Tensor, micro: dict[str, torch.Tensor]) -> torch.Tensor:
            return topk_kl(logits, micro["top_logp"], micro["top_ids"], micro["tail_logp"], s.tail)

        times: dict[str, list[float]] = {"in_ranks": [], "topk": [], "teacher": []}
        losses: dict[str, list[float]] = {"in_ranks": [], "topk": []}
        for i in range(total):
            rows = steps[(i // 2) % len(steps)]
            ids = windows[rows]
            t0 = time.perf_counter()
            if i % 2 == 0:
                target = forward(teacher, ids).clone()  # a normal tensor for autograd to keep, as heal does
                times["teacher"].append(time.perf_counter() - t0)
                result = trainer.step([{"input_ids": ids, "teacher": target}], full_loss)
                kind = "in_ranks"
            else:
                micro = {"input_ids": ids, "top_logp": top_logp[rows], "top_ids": top_ids[rows],
                         "tail_logp": tail_logp[rows]}
                result = trainer.step([micro], stored_loss)
                kind = "topk"
            times[kind].append(time.perf_counter() - t0)
            losses[kind].append(result.loss)
    finally:
        shutdown()
    return _summary(s, windows, times, losses, precompute_s, bytes_per_token, first_full, first_topk,
                    student.arch.vocab_size, topk_mass)


def _summary(s: Settings, windows: torch.Tensor, times: dict[str, list[float]], losses: dict[str, list[float]],
             precompute_s: float, bytes_per_token: int, first_full: float, first_topk: float,
             vocab: int, topk_mass: float) -> dict[str, Any]:
    median = {kind: statistics.median(t[s.skip:]) for kind, t in times.items()}
    tokens_per_step = s.batch * s.seq_len
    data_tokens = windows.numel()
    saved_per_epoch = (median["in_ranks"] - median["topk"]) * data_tokens / tokens_per_step
    return {
        "model": str(s.model), "teacher": str(s.teacher), "text": str(s.text), "k": s.k, "tail": s.tail,
        "vocab": vocab, "batch": s.batch, "seq_len": s.seq_len, "data_tokens": data_tokens,
        "timed_steps": s.steps - s.skip, "torch_threads": torch.get_num_threads(),
        "median_step_s": {"in_ranks": median["in_ranks"], "topk": median["topk"]},
        "median_teacher_s": median["teacher"],
        "precompute_s": precompute_s, "precompute_s_per_token": precompute_s / data_tokens,
        "storage_bytes_per_token": bytes_per_token, "full_logits_bytes_per_token": 4 * vocab,
        "break_even_epochs": precompute_s / saved_per_epoch if saved_per_epoch > 0 else None,
        "teacher_topk_mass": topk_mass,
        "first_kl_in_ranks": first_full, "first_kl_topk": first_topk,
        "loss": losses,
    }


def main(argv: Sequence[str] | None = None) -> int:
    from deinfer_megatron.cli.main import _quiet_known_warnings
    from deinfer_megatron.launch.run import run_on_ranks

    _quiet_known_warnings()  # Megatron's import-time warnings about absent GPU packages, as the CLI does
    try:
        s = parse(argv)
        summary = run_on_ranks(1, measure, s)
    except (ValueError, FileNotFoundError) as err:
        print(f"heal_teacher_compare.py: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
