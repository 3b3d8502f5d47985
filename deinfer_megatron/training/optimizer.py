"""The optimizer of a training step: AdamW, warm-up + cosine learning rate, gradient clipping.

Megatron's pieces where they run on the CPU, the project's own where they do not:

* AdamW is ``torch.optim.AdamW`` — what ``megatron.core.optimizer`` itself falls back to
  without Transformer Engine or Apex.
* The learning rate follows Megatron's ``OptimizerParamScheduler`` (linear warm-up, cosine
  decay to ``min_lr``), used as is.
* The gradient norm and clipping have the semantics of Megatron's ``get_grad_norm_fp32`` /
  ``clip_grad_by_total_norm_fp32``: the global L2 norm over the model-parallel group, each
  parameter counted once (Megatron's ``param_is_not_shared`` and
  ``param_is_not_tensor_parallel_duplicate`` filters, which read the tensor-parallel marks the
  layers set), then every gradient scaled by ``clip / (norm + 1e-6)`` when that is below one.
  Megatron's functions themselves allocate on ``"cuda"`` and assert CUDA gradient types, so
  the few lines are the project's own (``clip_by_global_norm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Sequence

import torch
import torch.distributed as dist

from deinfer_megatron.parallel import comm


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with a warm-up + cosine learning rate and gradient clipping.

    Attributes:
        lr: peak learning rate (reached after ``warmup_steps``).
        total_steps: optimizer steps of the whole run: the cosine decays from ``lr`` at the end
            of the warm-up to ``min_lr`` at ``total_steps``.
        warmup_steps: linear warm-up steps; step ``n`` (1-based) of the warm-up uses
            ``lr · n / warmup_steps``, so the first step already moves the weights.
        min_lr: the learning rate at the end of the cosine.
        weight_decay: AdamW's decoupled weight decay.
        betas, eps: AdamW's.
        clip_grad: the global gradient norm is clipped to this; 0 turns clipping off.
    """

    lr: float = 1e-4
    total_steps: int = 1000
    warmup_steps: int = 0
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be between 0 and lr ({self.lr}), got {self.min_lr}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(f"warmup_steps must be ≥ 0 and below total_steps ({self.total_steps}), "
                             f"got {self.warmup_steps}")
        if self.weight_decay < 0 or self.clip_grad < 0 or self.eps <= 0:
            raise ValueError("weight_decay and clip_grad must be ≥ 0 and eps > 0, got "
                             f"{self.weight_decay}, {self.clip_grad}, {self.eps}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")


def make_optimizer(params: Sequence[torch.nn.Parameter], cfg: OptimizerConfig) -> tuple[Any, Any]:
    """``(torch AdamW, Megatron OptimizerParamScheduler)`` over ``params``.

    A rank with nothing to train (a pipeline stage of dense layers when only factors train)
    gets no optimizer (None) and a scheduler over one empty group, so that it still reports
    the learning rate of the step.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                  weight_decay=cfg.weight_decay) if params else None
    scheduler = OptimizerParamScheduler(
        optimizer if optimizer is not None else SimpleNamespace(param_groups=[{}]), init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.warmup_steps, lr_decay_steps=cfg.total_steps, lr_decay_style="cosine",
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=cfg.total_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def counted_once(param: torch.nn.Parameter, tp_group: dist.ProcessGroup | None) -> bool:
    """Whether ``param`` enters the global gradient norm on this rank: Megatron's filters (not
    a copy shared with another stage, not a tensor-parallel duplicate)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, tp_group)


@torch.no_grad()
def clip_by_global_norm(params: Sequence[torch.nn.Parameter], max_norm: float,
                        tp_group: dist.ProcessGroup | None,
                        mp_group: dist.ProcessGroup | None) -> float:
    """The L2 norm of all gradients of the model (every rank's ``params``, each counted once,
    summed over ``mp_group``: TP × PP), and the gradients scaled down to ``max_norm`` if it is
    larger (``max_norm`` 0: measured, not clipped). Returns the norm before clipping."""

    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and counted_once(p, tp_group)]
    device = params[0].device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in counted:
        sq += g.detach().double().pow(2).sum()
    if mp_group is not None and dist.get_world_size(mp_group) > 1:
        sq = comm.sum_over_group(sq, mp_group)
    norm = float(sq.sqrt())
    if max_norm > 0:
        coeff = max_norm / (norm + 1.0e-6)
        if coeff < 1.0:
            for g in grads:
                g.mul_(coeff)
    return norm
