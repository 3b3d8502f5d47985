"""Training built model stages: the step, the optimizer, the learning rate and clipping.

The API (every rank of the job runs the same calls, in lockstep)::

    from deinfer_megatron.training import OptimizerConfig, Trainer

    stage = load_folder(path, Layout.DEINFER, groups)          # or build_stage + load_weights
    trainer = Trainer(stage, OptimizerConfig(lr=1e-4, warmup_steps=10, total_steps=500,
                                             clip_grad=1.0), train="factors")
    for micro_batches in batches:                          # the same list on every rank
        result = trainer.step(micro_batches, loss_fn)      # result.loss: same on every rank

* ``micro_batches``: a list of mappings, each with ``"input_ids"`` ``[b, s]`` (one shape for
  all), optionally ``"position_ids"``, and whatever the loss needs (labels, teacher logits).
  Gradients are accumulated over the list; each micro-batch's loss counts ``1/len``.
* ``loss_fn(logits, micro_batch) -> scalar``: called on the last pipeline stage only, with the
  full-vocabulary logits ``[b, s, vocab]`` (padding removed; identical on every TP rank, so
  any loss of them — cross-entropy, KL to a teacher — is correct as written for one process).
  Tensors made under ``torch.inference_mode`` (a teacher's ``stage_forward`` logits) must be
  cloned outside it before the loss uses them.
* ``train``: ``"all"``, ``"factors"`` (every U and V), ``"u"`` or ``"v"``; the rest is frozen.
* ``trainer.compute_gradients(micro_batches, loss_fn)`` and ``trainer.optimizer_step()`` are the
  two halves of ``step``; ``state_dict``/``load_state_dict`` carry the optimizer and schedule
  for resuming (the weights are the stage's own parameters).

docs/TRAINING.md says which parts are Megatron-Core's and which the project's own.
"""

from deinfer_megatron.training.optimizer import OptimizerConfig, clip_by_global_norm, make_optimizer
from deinfer_megatron.training.step import TRAIN_CHOICES, StepResult, Trainer, select_parameters

__all__ = ["OptimizerConfig", "Trainer", "StepResult", "TRAIN_CHOICES", "select_parameters",
           "clip_by_global_norm", "make_optimizer"]
