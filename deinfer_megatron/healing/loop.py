"""The healing loop, one for every student (``healing.student.Student``): the budget, the
schedule's length, the records, the JSON log and the progress bar, held-out evaluation,
checkpoints and resume.

Each step asks the student for one optimizer step on the step's batch (``HealData.batch``, a
pure function of the step) of the step's kind (``--distill``: logits, blocks, or blocks for the
first half of the budget then logits). The learning rate is the schedule of
``LoopSettings.optimizer`` — AdamW, linear warm-up, cosine to a tenth, Megatron's
``OptimizerParamScheduler`` — which both students build their optimizer from:

- a token budget is ``steps`` steps and the cosine ends at the last, so the run is a function
  of the step alone and a resumed run repeats the uninterrupted one bit for bit;
- a time budget (``seconds`` of training, global rank 0's clock, agreed by every rank each
  step) sets the cosine's length from the first step's duration, sets it again after every
  later warm-up step from the steps after the first (the first carries one-time costs:
  allocation, first touch of the weights; on 2 cores it took 1.5x a later step, so a length set
  from it ended the cosine at two thirds of the budget), and keeps it from the warm-up's end on.
  The warm-up's learning rate depends on the step alone, so no length set during it has been
  used yet. The length is kept in the checkpoint, so a resume follows the same schedule.

Every ``save_every`` steps the checkpoint is staged whole (``checkpoint.tmp/``: the student's
files on every rank, then ``meta.pt`` — step, records, elapsed time, schedule length — by the
reporting rank) and swapped in (``healing.state``). After the last step the student writes the
healed weights (``final/``) for the command's process.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
from tqdm import tqdm

from deinfer_megatron.files import failpoints
from deinfer_megatron.healing.state import FINAL, META, STAGED, checkpoint_dir, publish_checkpoint, stage_checkpoint
from deinfer_megatron.healing.student import Student
from deinfer_megatron.healing.watch import HeldOut
from deinfer_megatron.training import OptimizerConfig

MIN_LR_FRACTION = 0.1  # the cosine ends at a tenth of the peak learning rate
DISTILL = ("logits", "blocks", "blocks-then-logits")
BLOCKS_FRACTION = 0.5  # blocks-then-logits: the share of the budget spent block-wise
UNPLANNED = 10**9  # a time budget's schedule length until its first step sets it


@dataclass(frozen=True)
class LoopSettings:
    """The run's budget, schedule and cadence (picklable: it crosses to spawned ranks)."""

    lr: float
    warmup: int
    batch: int
    seq_len: int
    steps: int | None  # token budget, in steps
    seconds: float | None  # time budget
    clip: float = 1.0
    ce_weight: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    save_every: int = 0
    bf16: bool = False
    distill: str = "logits"  # one of DISTILL
    eval_every: int = 0  # steps between held-out evaluations (0: only before and after)

    def optimizer(self) -> OptimizerConfig:
        """AdamW (β 0.9, 0.95), ``warmup`` steps of linear warm-up to ``lr`` (at most all steps
        but one), a cosine to ``MIN_LR_FRACTION · lr`` at the budget's last step, clipping to
        ``clip``. A time budget's length is unknown until its first step (``Student.plan``,
        ``planned_steps``)."""
        total = self.steps if self.steps is not None else UNPLANNED
        return OptimizerConfig(lr=self.lr, total_steps=total, warmup_steps=min(self.warmup, total - 1),
                               min_lr=MIN_LR_FRACTION * self.lr, weight_decay=self.weight_decay,
                               betas=(0.9, 0.95), clip_grad=self.clip)

    def done(self, step: int, elapsed: float) -> bool:
        """Whether the budget is spent after ``step`` steps and ``elapsed`` seconds of training."""
        return (self.steps is not None and step >= self.steps) or (self.seconds is not None and elapsed >= self.seconds)

    def kind(self, step: int, elapsed: float) -> str:
        """The kind of the step that follows ``step`` steps and ``elapsed`` seconds."""
        if self.distill != "blocks-then-logits":
            return self.distill
        spent = step / self.steps if self.steps is not None else elapsed / (self.seconds or 1.0)
        return "blocks" if spent < BLOCKS_FRACTION else "logits"


def planned_steps(s: LoopSettings, step: int, elapsed: float, first: float) -> int:
    """A time budget's schedule length after ``step`` steps in ``elapsed`` seconds, the first
    of which took ``first``: the steps taken plus those the rest of the budget holds at the
    mean duration of the steps after the first (the first's own after one step), and never
    inside the warm-up."""
    per_step = first if step == 1 else (elapsed - first) / (step - 1)
    left = max(0.0, (s.seconds or 0.0) - elapsed)
    return max(s.warmup + 1, step + math.ceil(left / per_step) if per_step > 0 else step)


class Batches(Protocol):
    """The run's data: the ``batch`` windows of ``step``, a pure function of its arguments."""

    def batch(self, step: int, batch: int, seed: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class Healed:
    """What a run returns: every record (the log's lines) and the teacher's held-out perplexity."""

    records: list[dict[str, Any]]
    teacher_eval: dict[str, float] | None


@contextmanager
def _log(path: Path | None, records: list[dict[str, Any]]) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A writer of JSON lines to ``path`` (none: a writer that drops them), the records of a
    resumed run written first."""
    if path is None:
        yield lambda record: None
        return
    with open(path, "w", encoding="utf-8") as f:
        def write(record: dict[str, Any]) -> None:
            f.write(json.dumps(record) + "\n")
            f.flush()

        for record in records:
            write(record)
        yield write


def _bar(s: LoopSettings, step: int, elapsed: float, quiet: bool) -> tqdm:
    if s.steps is not None:
        return tqdm(total=s.steps, initial=step, desc="healing", unit="step", file=sys.stderr,
                    dynamic_ncols=True, disable=quiet)
    return tqdm(total=round(s.seconds or 0), initial=round(elapsed), desc="healing", unit="s", file=sys.stderr,
                dynamic_ncols=True, disable=quiet,
                bar_format="{l_bar}{bar}| {n:.0f}/{total} s [{remaining} left{postfix}]")


def _first_step_s(records: list[dict[str, Any]], step: int, elapsed: float) -> float:
    """The first step's duration: ``elapsed`` after it, or its record's (a resumed run's too)."""
    if step == 1:
        return elapsed
    return next(r["elapsed_s"] for r in records if r["step"] == 1)


def _checkpoint(student: Student, folder: Path, meta: dict[str, Any]) -> None:
    """Stage a checkpoint (every rank writes its part) and swap it in (collective)."""
    if student.reports:
        stage_checkpoint(folder)
    student.barrier()
    student.save(folder / STAGED)
    student.barrier()
    if student.reports:
        publish_checkpoint(folder, meta)
    student.barrier()


def train(student: Student, data: Batches, s: LoopSettings, *, state_folder: Path, resume: bool = False,
          log: Path | None = None, held_out: HeldOut | None = None) -> Healed:
    """Heal ``student`` on ``data`` until the budget of ``s`` is spent (every rank calls it),
    from the last checkpoint in ``state_folder`` when ``resume``; the student then writes the
    healed weights to ``state_folder / FINAL``.

    ``held_out`` (held-out perplexities) is measured before the first step, every
    ``eval_every`` steps and after the last, as the record's ``"eval"`` (step 0: a record of
    its own), and once on the teacher; its time is not counted in the budget. ``log``: the
    JSON-lines file the reporting rank writes every record to."""
    step, records, elapsed, planned = 0, [], 0.0, s.steps
    ckpt = checkpoint_dir(state_folder) if resume else None
    if ckpt is not None:
        meta = torch.load(ckpt / META, weights_only=True)
        student.load(ckpt)
        step, records, elapsed, planned = meta["step"], list(meta["records"]), meta["elapsed"], meta["planned"]
    if planned is not None:
        student.plan(planned)
    teacher_eval = held_out.perplexity_of(student.teacher_logits) if held_out is not None else None
    tokens_per_step = s.batch * s.seq_len
    with _log(log if student.reports else None, records) as write:
        if held_out is not None and step == 0:
            records.append({"step": 0, "tokens": 0, "elapsed_s": 0.0, "eval": held_out.perplexity_of(student.logits)})
            write(records[-1])
        bar = _bar(s, step, elapsed, quiet=not student.reports)
        try:
            while not s.done(step, elapsed):
                t0 = time.perf_counter()
                kind = s.kind(step, elapsed)
                out = student.step(data.batch(step, s.batch, s.seed), kind)
                failpoints.point("heal.after-step")
                dt = student.agreed(time.perf_counter() - t0)
                elapsed += dt
                step += 1
                if s.steps is None and step <= max(1, s.warmup):  # a time budget, still warming up
                    length = planned_steps(s, step, elapsed, _first_step_s(records, step, elapsed))
                    if length != planned:
                        planned = length
                        student.plan(planned)
                record = {"step": step, "kind": kind, "tokens": step * tokens_per_step, "loss": out.loss,
                          **out.parts, "lr": out.lr, "grad_norm": out.grad_norm,
                          "tokens_per_s": tokens_per_step / dt, "teacher_s": round(out.teacher_s, 4),
                          "elapsed_s": round(elapsed, 3)}
                if held_out is not None and ((s.eval_every and step % s.eval_every == 0) or s.done(step, elapsed)):
                    record["eval"] = held_out.perplexity_of(student.logits)
                records.append(record)
                write(record)
                bar.set_postfix(**{kind: f"{out.loss:.4f}"}, tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
                bar.update(1 if s.steps is not None else round(elapsed) - bar.n)
                if s.save_every and step % s.save_every == 0:
                    _checkpoint(student, state_folder,
                                {"step": step, "records": records, "elapsed": elapsed, "planned": planned})
        finally:
            bar.close()
    student.save_final(state_folder / FINAL)
    return Healed(records, teacher_eval)
