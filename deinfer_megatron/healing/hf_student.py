"""The one-process student: the decomposed folder as a Hugging Face model with factor pairs
(``models.hf_factored``), distilled from the dense Hugging Face model in the same process.

It takes logit steps (the KL of the next-token distributions, ``healing.loss``) and block-wise
steps (``healing.blocks``: every layer fed the teacher's input to it), which need the model's
layers one at a time — an entry point the Megatron stages do not have, so ``--distill blocks``
and ``blocks-then-logits`` run here. The optimizer and the learning-rate schedule are
``training.make_optimizer``'s, as the Megatron student's (``training.Trainer``); the gradient is
clipped by torch's ``clip_grad_norm_``, the same rule as ``training.clip_by_global_norm`` (the
L2 norm of every trained gradient, scaled by ``clip / (norm + 1e-6)`` when that is below one)
with no ranks to sum over.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from deinfer_megatron.checkpoints.folder import ModelFolder
from deinfer_megatron.healing.blocks import block_loss, teacher_layer_io
from deinfer_megatron.healing.loss import distill_loss
from deinfer_megatron.healing.student import STEP_KINDS, StepOutcome
from deinfer_megatron.models.hf_factored import folder_tensors, hf_model
from deinfer_megatron.training import OptimizerConfig, make_optimizer

STATE = "student.pt"  # its part of a checkpoint: trained weights, AdamW moments, schedule position
WEIGHTS = "model.safetensors"  # the healed weights in ``final/``, under the folder's names


def load_teacher(path: Path) -> nn.Module:
    """The dense model in float32, frozen."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa",
                                                              dtype=torch.float32)
    return model.eval().requires_grad_(False)


class HFStudent:
    """The ``healing.student.Student`` of one process.

    Args:
        folder: the opened decomposed folder (verified by the caller).
        teacher: the dense Hugging Face model (``load_teacher``).
        train: what trains (``models.hf_factored.TRAINABLE``).
        optimizer: AdamW, its schedule and the clipping (``LoopSettings.optimizer``).
        ce_weight: weight of the next-token cross-entropy beside the KL (logit steps).
        bf16: run the forward passes under CPU bfloat16 autocast (weights stay float32).
    """

    reports = True  # the only rank

    def __init__(self, folder: ModelFolder, teacher: nn.Module, *, train: str, optimizer: OptimizerConfig,
                 ce_weight: float = 0.0, bf16: bool = False) -> None:
        self.folder, self.teacher = folder, teacher
        self.model = hf_model(folder, trainable=train)
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer, self.scheduler = make_optimizer(list(self.params.values()), optimizer)
        self.clip = optimizer.clip_grad
        self.ce_weight, self.bf16 = ce_weight, bf16

    def plan(self, total_steps: int) -> None:
        self.scheduler.lr_decay_steps = total_steps

    def step(self, ids: torch.Tensor, kind: str) -> StepOutcome:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            if kind == "blocks":
                io = teacher_layer_io(self.teacher, ids)
                teacher_s = time.perf_counter() - t0
                loss = block_loss(self.model, io)
                parts = {"block_rel_mse": loss.item()}
            elif kind == "logits":
                with torch.no_grad():
                    target = self.teacher(ids).logits
                teacher_s = time.perf_counter() - t0
                loss, parts = distill_loss(self.model(ids).logits, target, ids, self.ce_weight)
            else:
                raise ValueError(f"unknown step kind {kind!r}; choose one of {', '.join(STEP_KINDS)}")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.clip or math.inf, foreach=False)
        self.scheduler.step(1)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        return StepOutcome(loss=loss.item(), grad_norm=norm.item(), lr=lr, teacher_s=teacher_s, parts=parts)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        try:
            with torch.no_grad():
                return self.model(ids).logits.float()
        finally:
            self.model.train()

    def teacher_logits(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.teacher(ids).logits.float()

    def agreed(self, seconds: float) -> float:
        return seconds

    def barrier(self) -> None:
        """One process: nothing to wait for."""

    def save(self, folder: Path) -> None:
        torch.save({"params": {n: p.detach() for n, p in self.params.items()},
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   folder / STATE)

    def load(self, folder: Path) -> None:
        state = torch.load(folder / STATE, weights_only=True)
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(state["params"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def save_final(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(folder_tensors(self.model, self.folder), str(folder / WEIGHTS))


def read_final(folder: Path) -> dict[str, torch.Tensor]:
    """The healed weights ``HFStudent.save_final`` wrote, under the decomposed folder's names."""
    return load_file(str(folder / WEIGHTS))
