"""The student on TP×PP ranks: the project's Megatron stage, trained by ``training.Trainer``,
distilled from the dense model built by the same builder in the same ranks (dense layout,
frozen, inference mode) — logit distillation, the default of ``heal``.

``heal_on_ranks`` is the job's body on every rank (``runtime.job.run_prepared`` loads the
student's stage and calls it): it builds the teacher and a :class:`MegatronStudent` and runs
the one healing loop (``healing.loop``) in lockstep on every rank. Every rank takes the same
batch (a pure function of the step); the teacher's logits come from ``stage_forward`` on the
last stage, and ``Trainer.step`` runs Megatron's schedule (1F1B when PP > 1) with the KL there.
The teacher runs in the ranks rather than having its logits computed once: its forward is a
fraction of the student's forward and backward (``teacher_s`` in the log), while stored logits
would be ``tokens × vocab`` floats (SmolLM2: 196 MB per 1024 tokens).

A checkpoint's part of the student is Megatron's ``dist_checkpointing`` of the stage
(``model/``, every tensor under its global shape) and each rank's ``Trainer.state_dict``
(``rank<k>.pt``); the healed student is a dist checkpoint too (``final/``), read whole by the
command's process (``read_final``).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.checkpoints.dist_checkpoint import load_model_state, read_hf_tensors, save_model_state
from deinfer_megatron.checkpoints.folder import ModelFolder
from deinfer_megatron.healing.data import HealData
from deinfer_megatron.healing.loop import Healed, LoopSettings, train
from deinfer_megatron.healing.loss import distill_loss
from deinfer_megatron.healing.student import StepOutcome
from deinfer_megatron.healing.watch import HeldOut
from deinfer_megatron.models.build import Stage, load_folder
from deinfer_megatron.models.pipeline import broadcast_from_last_stage, stage_forward
from deinfer_megatron.parallel import comm
from deinfer_megatron.planning.pricing import Workload
from deinfer_megatron.planning.preflight import Footprint
from deinfer_megatron.runtime.job import RankContext
from deinfer_megatron.runtime.options import DType, Engine, Parallelism
from deinfer_megatron.specs.layout import Layout, LayoutPlan
from deinfer_megatron.specs.rank_config import RankConfig
from deinfer_megatron.training import OptimizerConfig, Trainer


@dataclass(frozen=True)
class RankSettings:
    """What every rank needs (``runtime.job.JobSpec``; picklable: it crosses to spawned ranks):
    the folders and parallel layout of the student, and the loop's settings (logit distillation
    only: the job refuses the block-wise modes on ranks). The command checked everything before
    (``healing.job.validate``)."""

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


def _logits(stage: Stage, ids: torch.Tensor) -> torch.Tensor:
    """``[b, s, vocab]`` float32 logits of the whole model on every rank (collective)."""
    out = stage_forward(stage, ids, torch.arange(ids.shape[1]).expand_as(ids))
    like = torch.empty(*ids.shape, stage.arch.vocab_size, dtype=stage.model.config.params_dtype)
    return broadcast_from_last_stage(stage, out, like).float()


class MegatronStudent:
    """The ``healing.student.Student`` of one rank; every rank of the job holds one.

    Args:
        stage: this rank's loaded stage of the decomposed student.
        teacher: this rank's stage of the dense teacher (dense layout).
        train: what trains (``training.select_parameters``).
        optimizer: AdamW, its schedule and the clipping (``LoopSettings.optimizer``).
        ce_weight: weight of the next-token cross-entropy beside the KL.
        bf16: run the steps under CPU bfloat16 autocast (weights stay float32).
    """

    def __init__(self, stage: Stage, teacher: Stage, *, train: str, optimizer: OptimizerConfig,
                 ce_weight: float = 0.0, bf16: bool = False) -> None:
        self.stage, self.teacher = stage, teacher
        self.trainer = Trainer(stage, optimizer, train=train)
        self.ce_weight, self.bf16 = ce_weight, bf16
        self.rank = stage.groups.global_rank

    @property
    def reports(self) -> bool:
        return self.rank == 0

    def plan(self, total_steps: int) -> None:
        self.trainer.scheduler.lr_decay_steps = total_steps

    def step(self, ids: torch.Tensor, kind: str) -> StepOutcome:
        if kind != "logits":
            raise ValueError(f"the Megatron student takes logit steps only, not {kind!r}; "
                             "block-wise distillation runs in one process (--tp 1 --pp 1)")
        parts: dict[str, float] = {}

        def loss_fn(logits: torch.Tensor, micro: dict[str, torch.Tensor]) -> torch.Tensor:
            loss, got = distill_loss(logits, micro["teacher"], micro["input_ids"], self.ce_weight)
            parts.update(got)
            return loss

        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            target = stage_forward(self.teacher, ids, torch.arange(ids.shape[1]).expand_as(ids))
        teacher_s = time.perf_counter() - t0
        micro = {"input_ids": ids}
        if target is not None:  # the last stage: a normal tensor for autograd to keep
            micro["teacher"] = target.clone()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            result = self.trainer.step([micro], loss_fn)
        # the loss's parts exist on the last stage; every rank records them
        got = torch.tensor([parts.get("kl", 0.0), parts.get("ce", 0.0)], dtype=torch.float64)
        got = broadcast_from_last_stage(self.stage, got if self.stage.groups.is_last_stage else None, got).cpu()
        return StepOutcome(loss=result.loss, grad_norm=result.grad_norm, lr=result.lr, teacher_s=teacher_s,
                           parts={"kl": float(got[0]), **({"ce": float(got[1])} if self.ce_weight else {})})

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return _logits(self.stage, ids)

    def teacher_logits(self, ids: torch.Tensor) -> torch.Tensor:
        return _logits(self.teacher, ids)

    def agreed(self, seconds: float) -> float:
        return float(comm.broadcast_from(torch.tensor([seconds], dtype=torch.float64), 0, None)[0])

    def barrier(self) -> None:
        comm.world_barrier(self.stage.groups.device)

    def save(self, folder: Path) -> None:
        (folder / "model").mkdir(exist_ok=True)
        self.barrier()  # Megatron saves into an existing folder
        save_model_state(self.stage, folder / "model")
        torch.save(self.trainer.state_dict(), folder / f"rank{self.rank}.pt")

    def load(self, folder: Path) -> None:
        load_model_state(self.stage, folder / "model", self.stage.rank_config)
        self.trainer.load_state_dict(torch.load(folder / f"rank{self.rank}.pt", weights_only=True))

    def save_final(self, folder: Path) -> None:
        if self.reports:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        self.barrier()
        save_model_state(self.stage, folder)
        self.barrier()


def read_final(folder: Path, dec: ModelFolder) -> dict[str, torch.Tensor]:
    """The healed weights of ``MegatronStudent.save_final``, every rank's shards reassembled
    under the decomposed folder's names (read in the command's process, no process group)."""
    tensors = read_hf_tensors(folder, dec.arch, dec.rank_config)
    missing = set(dec.source) - set(tensors)
    assert not missing, f"the healed checkpoint lacks {sorted(missing)[:3]}"
    return {name: tensors[name].contiguous() for name in dec.source}


def heal_on_ranks(ctx: RankContext, data_fn: Callable[[int], HealData], held_out: HeldOut | None) -> Healed:
    """One rank of the job (``runtime.job.run_prepared``'s body, the student loaded): the loop,
    then ``final/``; the caller keeps global rank 0's result.

    ``data_fn(rank)``: global rank 0 builds the windows (the teacher may write conversations)
    and saves them in the state folder; the other ranks then read them from there."""
    s: RankSettings = ctx.spec
    rank = ctx.groups.global_rank
    data = data_fn(rank) if rank == 0 else None
    comm.world_barrier(ctx.groups.device)
    data = data if data is not None else data_fn(rank)
    teacher = load_folder(s.teacher, Layout.DENSE, ctx.groups, verify=False)  # the command verified it
    student = MegatronStudent(ctx.stage, teacher, train=s.train, optimizer=s.loop.optimizer(),
                              ce_weight=s.loop.ce_weight, bf16=s.loop.bf16)
    return train(student, data, s.loop, state_folder=s.state_folder, resume=s.resume, log=s.json_log,
                 held_out=held_out)

