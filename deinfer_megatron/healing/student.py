"""What the healing loop asks of the model it trains, whichever model that is.

``healing.loop`` owns the run — budgets, the schedule's length, records, the log and the bar,
held-out evaluation, checkpoints and resume — and asks a :class:`Student` only what depends on
the model: one optimizer step on a batch, logits, its part of a checkpoint, and the healed
weights. Two students implement it:

- ``healing.megatron_student.MegatronStudent``: the project's Megatron stage on TP×PP ranks,
  trained by ``training.Trainer``; its teacher is the dense stage in the same ranks. Every rank
  holds one and the loop runs on every rank in lockstep.
- ``healing.hf_student.HFStudent``: the Hugging Face factor-pair model of
  ``models.hf_factored`` in one process, with ``training.make_optimizer``'s AdamW and schedule;
  its teacher is the dense Hugging Face model. It also takes block-wise steps.

Both take the optimizer, the learning-rate schedule and the clipping from one
``training.OptimizerConfig`` (the loop's ``LoopSettings.optimizer``), so a step's learning rate
is Megatron's ``OptimizerParamScheduler`` at that step for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

STEP_KINDS = ("logits", "blocks")  # KL of the logits; each layer on the teacher's layer input


@dataclass(frozen=True)
class StepOutcome:
    """One optimizer step, the same on every rank.

    Attributes:
        loss: the loss the step minimised, before the update.
        parts: its named parts for the record (``kl`` and, with a CE weight, ``ce`` for a logit
            step; ``block_rel_mse`` for a block step).
        grad_norm: the global gradient norm before clipping.
        lr: the learning rate the update used.
        teacher_s: seconds of the step spent in the teacher's forward.
    """

    loss: float
    grad_norm: float
    lr: float
    teacher_s: float
    parts: dict[str, float] = field(default_factory=dict)


class Student(Protocol):
    """The model the loop trains and the teacher it is distilled from.

    Every method is called on every rank of the job in the same order (the collective ones
    communicate); ``reports`` says which rank writes what the run shows (log, bar, checkpoint
    metadata)."""

    @property
    def reports(self) -> bool:
        """Whether this rank writes the log, the bar and the checkpoint's ``meta.pt``."""

    def plan(self, total_steps: int) -> None:
        """Fix the schedule's length: the cosine reaches its minimum at ``total_steps``."""

    def step(self, ids: torch.Tensor, kind: str) -> StepOutcome:
        """One optimizer step on the batch ``ids [b, s]`` of ``kind`` (one of ``STEP_KINDS``);
        the learning rate is the schedule's at the step's (1-based) index."""

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The student's ``[b, s, vocab]`` float32 logits, no gradient (on every rank)."""

    def teacher_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The teacher's ``[b, s, vocab]`` float32 logits (on every rank)."""

    def agreed(self, seconds: float) -> float:
        """Global rank 0's ``seconds`` on every rank: one clock decides the time budget."""

    def barrier(self) -> None:
        """Wait for every rank (a checkpoint's files complete)."""

    def save(self, folder: Path) -> None:
        """Write this rank's part of a checkpoint (weights, optimizer, schedule) into the existing
        staging ``folder``."""

    def load(self, folder: Path) -> None:
        """Continue from a checkpoint ``save`` wrote."""

    def save_final(self, folder: Path) -> None:
        """Write the healed weights into ``folder`` (made here), for the command's process to
        read (the student's module's ``read_final``)."""
