"""The distillation loop: AdamW, linear warm-up then cosine decay, gradient clipping.

Each step runs the teacher (no gradient) and the student on the same batch and minimises the
KL between their next-token distributions (``logits``), or each layer's error on the
teacher's own layer inputs (``blocks``, see ``healing.blocks``), or the one then the other. Every step is one JSON record (loss, learning
rate, gradient norm, tokens/s); every ``save_every`` steps the state is checkpointed
atomically. With a token budget the schedule is a function of the step alone, so a resumed
run repeats the uninterrupted one exactly; with a time budget it follows the elapsed time.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

import torch
from torch import nn
from tqdm import tqdm

from deinfer_megatron.files import failpoints
from deinfer_megatron.healing.blocks import block_loss, teacher_layer_io
from deinfer_megatron.healing.data import HealData
from deinfer_megatron.healing.loss import distill_loss
from deinfer_megatron.healing.state import save_checkpoint

MIN_LR_FRACTION = 0.1  # the cosine ends at a tenth of the peak learning rate
DISTILL = ("logits", "blocks", "blocks-then-logits")
BLOCKS_FRACTION = 0.5  # blocks-then-logits: the share of the budget spent block-wise


@dataclass(frozen=True)
class LoopSettings:
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


def step_kind(s: LoopSettings, progress: float) -> str:
    """"logits" or "blocks" for a step at ``progress`` ∈ [0, 1) of the budget."""
    if s.distill == "blocks-then-logits":
        return "blocks" if progress < BLOCKS_FRACTION else "logits"
    return s.distill


def learning_rate(s: LoopSettings, step: int, progress: float) -> float:
    """Warm-up over ``warmup`` steps, then cosine from ``lr`` to ``MIN_LR_FRACTION·lr`` over
    ``progress`` ∈ [0, 1] (the fraction of the budget spent)."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return s.lr * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cos)


def make_optimizer(params: list[nn.Parameter], s: LoopSettings) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.95), foreach=False)


def _progress_bar(s: LoopSettings, start_step: int, elapsed: float) -> tqdm:
    if s.steps is not None:
        return tqdm(total=s.steps, initial=start_step, desc="healing", unit="step", file=sys.stderr,
                    dynamic_ncols=True)
    return tqdm(total=round(s.seconds or 0), initial=round(elapsed), desc="healing", unit="s",
                file=sys.stderr, dynamic_ncols=True, bar_format="{l_bar}{bar}| {n:.0f}/{total} s [{remaining} left{postfix}]")


def _write(log: TextIO | None, record: dict[str, Any]) -> None:
    if log is not None:
        log.write(json.dumps(record) + "\n")
        log.flush()


def train(student: nn.Module, teacher: nn.Module, names: list[str], data: HealData, s: LoopSettings, *,
          state_folder: Path, start: dict[str, Any] | None, log: TextIO | None,
          on_record: Callable[[dict[str, Any]], None] | None = None,
          evaluate: Callable[[nn.Module], dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """Run the loop from ``start`` (a loaded checkpoint, or None); returns every step's record.

    ``evaluate`` (held-out perplexities) runs before the first step, every ``eval_every``
    steps and after the last; its result is the record's ``"eval"`` entry (step 0: a record
    of its own)."""
    params = dict(student.named_parameters())
    trainable = [params[n] for n in names]
    optim = make_optimizer(trainable, s)
    step, records, elapsed = 0, [], 0.0
    if start is not None:
        with torch.no_grad():
            for n in names:
                params[n].copy_(start["params"][n])
        optim.load_state_dict(start["optim"])
        step, records, elapsed = start["step"], list(start["records"]), start["elapsed"]
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if s.bf16 else nullcontext
    if evaluate is not None and step == 0:
        records.append({"step": 0, "tokens": 0, "elapsed_s": 0.0, "eval": evaluate(student)})
        _write(log, records[-1])
    bar = _progress_bar(s, step, elapsed)
    tokens_per_step = s.batch * s.seq_len
    try:
        while (s.steps is None or step < s.steps) and (s.seconds is None or elapsed < s.seconds):
            t0 = time.perf_counter()
            ids = data.batch(step, s.batch, s.seed)
            done = step / s.steps if s.steps is not None else elapsed / (s.seconds or 1.0)
            kind = step_kind(s, done)
            with autocast():
                if kind == "blocks":
                    loss = block_loss(student, teacher_layer_io(teacher, ids))
                    parts = {"block_rel_mse": loss.item()}
                else:
                    with torch.no_grad():
                        target = teacher(ids).logits
                    loss, parts = distill_loss(student(ids).logits, target, ids, s.ce_weight)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, s.clip, foreach=False).item()
            progress = (step + 1) / s.steps if s.steps is not None else elapsed / (s.seconds or 1.0)
            lr = learning_rate(s, step, progress)
            for group in optim.param_groups:
                group["lr"] = lr
            optim.step()
            failpoints.point("heal.after-step")
            dt = time.perf_counter() - t0
            elapsed += dt
            step += 1
            record = {"step": step, "kind": kind, "tokens": step * tokens_per_step, "loss": loss.item(), **parts,
                      "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / dt,
                      "elapsed_s": round(elapsed, 3)}
            last = (s.steps is not None and step >= s.steps) or (s.seconds is not None and elapsed >= s.seconds)
            if evaluate is not None and ((s.eval_every and step % s.eval_every == 0) or last):
                record["eval"] = evaluate(student)
            records.append(record)
            _write(log, record)
            if on_record is not None:
                on_record(record)
            bar.set_postfix(**{kind: f"{loss.item():.4f}"}, tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            bar.update(1 if s.steps is not None else round(elapsed) - bar.n)
            if s.save_every and step % s.save_every == 0:
                save_checkpoint(state_folder, step, {n: params[n].detach().clone() for n in names},
                                optim.state_dict(), records, elapsed)
    finally:
        bar.close()
    return records
