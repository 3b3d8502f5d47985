"""One training step of a built model stage, with Megatron-Core's schedules.

Forward and backward run through Megatron's ``get_forward_backward_func``: its
``forward_backward_no_pipelining`` at PP 1 and its 1F1B
``forward_backward_pipelining_without_interleaving`` at PP > 1, which sends activations forward
and their gradients backward between stages (both run on the CPU under the shims of
``patches.megatron_cpu``). What Megatron's ``finalize_model_grads`` would add is done here:
there is no data parallelism to reduce over, and the two copies of tied embeddings across
stages (the project builds the head as its own parameter when PP > 1) get the sum of their
gradients over Megatron's embedding group, as Megatron's ``_allreduce_word_embedding_grads``
does. The optimizer step is ``training.optimizer``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch import nn

from deinfer_megatron.layers.factors import DownFactor, UpFactor
from deinfer_megatron.models.build import Stage
from deinfer_megatron.parallel import comm
from deinfer_megatron.training.optimizer import OptimizerConfig, clip_by_global_norm, make_optimizer

MicroBatch = Mapping[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, MicroBatch], torch.Tensor]

TRAIN_CHOICES = ("all", "linear", "factors", "u", "v")
_EMBEDDING = "embedding.word_embeddings.weight"
_HEAD = "output_layer.weight"
_HEAD_MODULE = _HEAD.partition(".")[0]


def select_parameters(model: nn.Module, train: str) -> list[tuple[str, nn.Parameter]]:
    """The parameters ``train`` names: ``"all"``; ``"linear"`` (every matrix of the transformer
    blocks — the factors and the matrices the rank config kept dense, with their biases — but not
    the embeddings, the output layer or the norms); ``"factors"`` (every U and V factor of the
    decomposed blocks, U's biases included); ``"u"`` (up factors) or ``"v"`` (down factors)."""
    if train not in TRAIN_CHOICES:
        raise ValueError(f"unknown train selection {train!r}; choose one of {', '.join(TRAIN_CHOICES)}")
    if train == "all":
        return list(model.named_parameters())
    kinds = {"linear": (DownFactor, UpFactor, ColumnParallelLinear, RowParallelLinear, nn.Linear),
             "factors": (DownFactor, UpFactor), "u": (UpFactor,), "v": (DownFactor,)}[train]
    out: list[tuple[str, nn.Parameter]] = []
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == _HEAD_MODULE:
            continue  # a column-parallel linear too, but the head (tied to the embedding) is no block's
        if isinstance(module, kinds):
            out += [(f"{name}.{n}", p) for n, p in module.named_parameters(recurse=False)]
    return out


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did (the same on every rank).

    Attributes:
        loss: the mean of ``loss_fn`` over the micro-batches, before the update.
        grad_norm: the global gradient norm before clipping.
        lr: the learning rate the step used.
        step: optimizer steps done so far (this one included).
    """

    loss: float
    grad_norm: float
    lr: float
    step: int


class Trainer:
    """Trains one rank's stage; every rank of the job builds one and calls it in lockstep.

    Args:
        stage: the rank's built and loaded stage (``models.build``).
        config: optimizer, learning-rate schedule and clipping.
        train: which parameters are trained (``select_parameters``); the others are frozen.
    """

    def __init__(self, stage: Stage, config: OptimizerConfig, *, train: str = "all") -> None:
        self.stage, self.config = stage, config
        model, groups = stage.model, stage.groups
        chosen = select_parameters(model, train)
        self.tied_across_stages = stage.arch.tied_embeddings and groups.pp_size > 1 and train == "all"
        model.requires_grad_(False)
        for _, p in chosen:
            p.requires_grad_(True)
        self.names = [n for n, _ in chosen]
        self.params = [p for _, p in chosen]
        selected = torch.tensor(float(len(self.params)), device=stage.device)
        if groups.pg_collection.mp is not None and dist.get_world_size(groups.pg_collection.mp) > 1:
            selected = comm.sum_over_group(selected, groups.pg_collection.mp)
        if selected.item() == 0:
            raise ValueError(f"nothing to train: train={train!r} selects no parameter of this model "
                             f"(the {stage.layout.value} layout has no factors when it multiplies "
                             "them out); choose another --train or layout")
        if self.tied_across_stages and groups.is_last_stage:
            # One matrix in two places: its gradient norm is counted on the first stage only.
            dict(model.named_parameters())[_HEAD].shared = True
        self.optimizer, self.scheduler = make_optimizer(self.params, config)
        self.steps = 0

    # ----------------------------------------------------------------- forward and backward

    def _forward_step(self, loss_fn: LossFn, data: Iterator[MicroBatch], model: Any) -> tuple[Any, Any]:
        batch = next(data)
        groups, device = self.stage.groups, self.stage.device
        ids = batch["input_ids"].to(device)
        pos = batch.get("position_ids")
        pos = (torch.arange(ids.shape[1]).expand_as(ids) if pos is None else pos).to(device)
        out = model(ids if groups.is_first_stage else None, pos, None, runtime_gather_output=True)
        return out, partial(self._loss, loss_fn, batch)

    def _loss(self, loss_fn: LossFn, batch: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = loss_fn(logits[..., : self.stage.arch.vocab_size], batch)
        if loss.dim() != 0:
            raise ValueError(f"the loss function must return a scalar, got shape {list(loss.shape)}")
        return loss, {"loss": loss.detach()}

    def compute_gradients(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn) -> float:
        """Zero the gradients, run forward and backward over ``micro_batches`` (accumulated,
        each micro-batch's loss divided by their number, as Megatron does) and finish them
        across stages. Returns the mean loss, on every rank."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        if not micro_batches:
            raise ValueError("a training step needs at least one micro-batch")
        shapes = {tuple(b["input_ids"].shape) for b in micro_batches}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"every micro-batch's input_ids must be [batch, seq] of one shape, got {sorted(shapes)}")
        (b, s), = shapes
        groups, model = self.stage.groups, self.stage.model
        for p in self.params:
            p.grad = None
        schedule = get_forward_backward_func(pp_size=groups.pp_size)
        extra: dict[str, Any] = {}
        if groups.pp_size > 1:
            extra["p2p_communicator"] = P2PCommunicator(pp_group=groups.pg_collection.pp, config=model.config)
        was_training = model.training
        model.train()
        try:
            out = schedule(
                forward_step_func=partial(self._forward_step, loss_fn),
                data_iterator=iter(micro_batches), model=model, num_microbatches=len(micro_batches),
                seq_length=s, micro_batch_size=b, forward_only=False,
                pg_collection=groups.pg_collection, **extra,
            )
        finally:
            model.train(was_training)
        self._finish_gradients()
        if groups.is_last_stage:
            loss = torch.stack([d["loss"] for d in out]).mean().to(torch.float64)
        else:
            loss = torch.zeros((), dtype=torch.float64)
        loss = loss.to(self.stage.device)
        if groups.pp_size > 1:
            loss = comm.broadcast_from(loss, groups.last_stage_rank, groups.pg_collection.pp)
        return float(loss)

    def _finish_gradients(self) -> None:
        """The tied embedding and head (first and last stage) each get the sum of both
        gradients, so the two copies stay one matrix."""
        if not self.tied_across_stages:
            return
        groups = self.stage.groups
        named = dict(self.stage.model.named_parameters())
        name = _EMBEDDING if groups.is_first_stage else _HEAD if groups.is_last_stage else None
        if name is None:
            return
        param = named[name]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        comm.sum_over_group(param.grad, groups.pg_collection.embd)

    # ------------------------------------------------------------------------- the update

    def optimizer_step(self) -> tuple[float, float]:
        """Clip the gradients already computed and update the parameters; returns
        ``(grad_norm before clipping, learning rate used)``. Step ``n`` (1-based) uses
        Megatron's scheduled learning rate at ``n``."""
        groups = self.stage.groups
        self.scheduler.step(1)
        norm = clip_by_global_norm(self.params, self.config.clip_grad,
                                   groups.pg_collection.tp, groups.pg_collection.mp)
        lr = float(self.scheduler.optimizer.param_groups[0]["lr"])
        if self.optimizer is not None:
            self.optimizer.step()
        self.steps += 1
        return norm, lr

    def step(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn) -> StepResult:
        """One optimizer step: gradients of ``loss_fn`` over ``micro_batches``, then the update."""
        loss = self.compute_gradients(micro_batches, loss_fn)
        norm, lr = self.optimizer_step()
        return StepResult(loss=loss, grad_norm=norm, lr=lr, step=self.steps)

    # ----------------------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """Optimizer moments, scheduler position and step count of this rank (for resuming)."""
        return {"optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state_dict()`` of the same rank with the same selection."""
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])
