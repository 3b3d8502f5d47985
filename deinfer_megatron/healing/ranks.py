"""Logit distillation on TP×PP ranks: the student is the project's Megatron stage, trained by
``training.Trainer``; the teacher is the dense model built by the same builder in the same
ranks (dense layout, frozen, inference mode).

Every rank runs the same steps in lockstep on the same batch (``HealData.batch`` is a pure
function of the step). The teacher runs in the ranks rather than having its logits computed
once: a step's teacher forward costs a fraction of the student's forward + backward (each
record's ``teacher_s`` says how much), while stored logits would be ``tokens × vocab`` floats
(SmolLM2: 196 MB per 1024 tokens) read back every step.

Checkpoints (``save_every``) are a staged folder swapped in whole: Megatron's
``dist_checkpointing`` of the student (every tensor under its global shape), each rank's
``Trainer.state_dict`` and rank 0's log so far. The healed model itself is written the same
way (``final/``) and the command's main process turns it into a decomposed folder.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

import torch
from tqdm import tqdm

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.checkpoints.dist_checkpoint import load_model_state, save_model_state
from deinfer_megatron.files import failpoints
from deinfer_megatron.healing.data import HealData
from deinfer_megatron.healing.loop import MIN_LR_FRACTION, LoopSettings
from deinfer_megatron.healing.loss import distill_loss
from deinfer_megatron.healing.watch import HeldOut
from deinfer_megatron.models.build import load_folder
from deinfer_megatron.models.pipeline import broadcast_from_last_stage, stage_forward
from deinfer_megatron.parallel import comm
from deinfer_megatron.planning.pricing import Workload
from deinfer_megatron.planning.preflight import Footprint
from deinfer_megatron.runtime.job import RankContext
from deinfer_megatron.runtime.options import DType, Engine, Parallelism
from deinfer_megatron.specs.layout import Layout, LayoutPlan
from deinfer_megatron.specs.rank_config import RankConfig
from deinfer_megatron.training import OptimizerConfig, Trainer

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint"  # the last complete checkpoint, inside the state folder
FINAL = "final"  # the healed student as a dist checkpoint, read by the main process


@dataclass(frozen=True)
class RankSettings:
    """What every rank needs to run the loop (``runtime.job.JobSpec``; picklable: it crosses to
    spawned ranks): the folders and parallel layout of the student, and the same ``LoopSettings``
    the one-process loop takes (its ``distill`` and ``weight_decay`` are not used here: the ranks
    distil logits only). The command checked everything before (``healing.job.validate``)."""

    model: Path
    teacher: Path
    state_folder: Path
    parallel: Parallelism
    train: str
    loop: LoopSettings
    json_log: Path | None
    resume: bool
    dtype = DType.FLOAT32  # the weights; ``loop.bf16`` autocasts the compute
    engine = Engine.MEGATRON
    verify = False  # the command verified both folders

    def check(self, arch: ModelArch, rank_config: RankConfig) -> None:
        if not rank_config.modules:
            raise ValueError(f"--model {self.model} has no factors to heal; give a decomposed folder")

    def workload(self) -> Workload:
        return Workload(tp=self.parallel.tp, batch=self.loop.batch, context=self.loop.seq_len)

    def footprint(self, arch: ModelArch) -> Footprint:
        """A step's forward of ``batch`` windows, each its own context, every row's logits."""
        rows = self.loop.batch * self.loop.seq_len
        return Footprint(prefill_rows=rows, context=self.loop.seq_len, logit_rows=rows, rows_option="--batch")

    def check_plan(self, plan: LayoutPlan) -> None:
        if plan.multiplies_out:
            raise ValueError("the dense layout multiplies the factors out: there are no factors to heal")


def checkpoint_dir(state_folder: Path) -> Path | None:
    """The complete checkpoint to resume from (a kill between the two renames of a swap leaves
    the previous one as ``checkpoint.old``), or None."""
    for name in (CHECKPOINT, f"{CHECKPOINT}.old"):
        if (state_folder / name / "meta.pt").is_file():
            return state_folder / name
    return None


def _perplexity_fn(stage: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    def logits(ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        out = stage_forward(stage, ids, pos)
        like = torch.empty(*ids.shape, stage.arch.vocab_size, dtype=stage.model.config.params_dtype)
        return broadcast_from_last_stage(stage, out, like).float()

    return logits


def _save(s: RankSettings, student: Any, trainer: Any, groups: Any, rank: int, meta: dict[str, Any]) -> None:
    """Stage a checkpoint in ``checkpoint.tmp`` and swap it in (collective)."""
    tmp = s.state_folder / f"{CHECKPOINT}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-staged checkpoint of a killed run
        (tmp / "model").mkdir(parents=True)
    comm.world_barrier(groups.device)
    save_model_state(student, tmp / "model")
    torch.save(trainer.state_dict(), tmp / f"rank{rank}.pt")
    comm.world_barrier(groups.device)
    if rank == 0:
        torch.save(meta, tmp / "meta.pt")  # last: its presence means complete
        final, old = s.state_folder / CHECKPOINT, s.state_folder / f"{CHECKPOINT}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        failpoints.point("heal.after-checkpoint")
    comm.world_barrier(groups.device)


def _bar(s: RankSettings, step: int, elapsed: float, quiet: bool) -> tqdm:
    if s.loop.steps is not None:
        return tqdm(total=s.loop.steps, initial=step, desc="healing", unit="step", file=sys.stderr,
                    dynamic_ncols=True, disable=quiet)
    return tqdm(total=round(s.loop.seconds or 0), initial=round(elapsed), desc="healing", unit="s", file=sys.stderr,
                dynamic_ncols=True, disable=quiet,
                bar_format="{l_bar}{bar}| {n:.0f}/{total} s [{remaining} left{postfix}]")


def _write(log_file: TextIO | None, record: dict[str, Any]) -> None:
    if log_file is not None:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()


def heal_on_ranks(ctx: RankContext, data_fn: Callable[[int], HealData], held_out: HeldOut | None) -> dict[str, Any]:
    """One rank of the job (``runtime.job.run_prepared``'s body, the student loaded): train,
    checkpoint, write ``final/``; returns the records and the teacher's held-out perplexity (the
    caller keeps global rank 0's).

    ``data_fn(rank)``: global rank 0 builds the windows (the teacher may write conversations)
    and saves them in the state folder; the other ranks then read them from there."""
    s: RankSettings = ctx.spec
    loop, groups, student = s.loop, ctx.groups, ctx.stage
    rank = groups.global_rank
    data = data_fn(rank) if rank == 0 else None
    comm.world_barrier(groups.device)
    data = data if data is not None else data_fn(rank)
    teacher = load_folder(s.teacher, Layout.DENSE, groups, verify=False)  # the command verified it
    # A time budget's cosine runs over the steps the first step says fit (fixed then, and
    # kept in the checkpoint, so a resume follows the same schedule).
    total = loop.steps if loop.steps is not None else max(loop.warmup + 1, 10**9)
    config = OptimizerConfig(lr=loop.lr, total_steps=total, warmup_steps=min(loop.warmup, total - 1),
                             min_lr=MIN_LR_FRACTION * loop.lr, betas=(0.9, 0.95), clip_grad=loop.clip)
    trainer = Trainer(student, config, train=s.train)
    step, records, elapsed, planned = 0, [], 0.0, loop.steps
    ckpt = checkpoint_dir(s.state_folder) if s.resume else None
    if ckpt is not None:
        meta = torch.load(ckpt / "meta.pt", weights_only=True)
        load_model_state(student, ckpt / "model", student.rank_config)
        trainer.load_state_dict(torch.load(ckpt / f"rank{rank}.pt", weights_only=True))
        step, records, elapsed, planned = meta["step"], list(meta["records"]), meta["elapsed"], meta["planned"]
    if planned is not None and loop.steps is None:
        trainer.scheduler.lr_decay_steps = planned
    log_file = None
    if rank == 0 and s.json_log is not None:
        log_file = open(s.json_log, "w", encoding="utf-8")
        for record in records:
            _write(log_file, record)
    teacher_eval = None
    if held_out is not None:
        teacher_eval = held_out.perplexity_of(_perplexity_fn(teacher))
        if step == 0:
            records.append({"step": 0, "tokens": 0, "elapsed_s": 0.0,
                            "eval": held_out.perplexity_of(_perplexity_fn(student))})
            _write(log_file, records[-1])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=loop.bf16)
    tokens_per_step = loop.batch * loop.seq_len
    bar = _bar(s, step, elapsed, quiet=rank != 0)
    parts: dict[str, float] = {}

    def loss_fn(logits: torch.Tensor, micro: dict[str, torch.Tensor]) -> torch.Tensor:
        loss, got = distill_loss(logits, micro["teacher"], micro["input_ids"], loop.ce_weight)
        parts.update(got)
        return loss

    try:
        while (loop.steps is None or step < loop.steps) and (loop.seconds is None or elapsed < loop.seconds):
            t0 = time.perf_counter()
            ids = data.batch(step, loop.batch, loop.seed)
            pos = torch.arange(ids.shape[1]).expand_as(ids)
            with autocast:
                target = stage_forward(teacher, ids, pos)
            t_teacher = time.perf_counter() - t0
            micro = {"input_ids": ids}
            if target is not None:  # the last stage: a normal tensor for autograd to keep
                micro["teacher"] = target.clone()
            with autocast:
                result = trainer.step([micro], loss_fn)
            kl = torch.tensor([parts.get("kl", 0.0), parts.get("ce", 0.0)], dtype=torch.float64)
            kl = broadcast_from_last_stage(student, kl if groups.is_last_stage else None, kl).cpu()
            failpoints.point("heal.after-step")
            # every rank must agree on the time budget and its schedule: rank 0's clock decides
            dt = float(comm.broadcast_from(torch.tensor([time.perf_counter() - t0], dtype=torch.float64),
                                           0, None)[0])
            elapsed += dt
            step += 1
            if planned is None:  # time budget: the schedule is fixed by the first step
                planned = max(loop.warmup + 1, math.ceil((loop.seconds or 0) / dt))
                trainer.scheduler.lr_decay_steps = planned
            record = {"step": step, "kind": "logits", "tokens": step * tokens_per_step, "loss": result.loss,
                      "kl": float(kl[0]), **({"ce": float(kl[1])} if loop.ce_weight else {}),
                      "lr": result.lr, "grad_norm": result.grad_norm, "tokens_per_s": tokens_per_step / dt,
                      "teacher_s": round(t_teacher, 4), "elapsed_s": round(elapsed, 3)}
            last = (loop.steps is not None and step >= loop.steps) or (loop.seconds is not None and elapsed >= loop.seconds)
            if held_out is not None and ((loop.eval_every and step % loop.eval_every == 0) or last):
                record["eval"] = held_out.perplexity_of(_perplexity_fn(student))
            records.append(record)
            _write(log_file, record)
            bar.set_postfix(kl=f"{record['kl']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            bar.update(1 if loop.steps is not None else round(elapsed) - bar.n)
            if loop.save_every and step % loop.save_every == 0:
                _save(s, student, trainer, groups, rank,
                      {"step": step, "records": records, "elapsed": elapsed, "planned": planned})
    finally:
        bar.close()
        if log_file is not None:
            log_file.close()
    final = s.state_folder / FINAL
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        final.mkdir(parents=True)
    comm.world_barrier(groups.device)
    save_model_state(student, final)
    comm.world_barrier(groups.device)
    return {"records": records, "teacher_eval": teacher_eval}
