"""Block-wise distillation: every decoder layer of the student is fed the teacher's input to
that layer and matched to the teacher's output, all layers in one step.

Each layer learns to undo its own decomposition error on the inputs it will see once the
layers before it are healed too, with no gradient through the rest of the model and no
vocabulary-sized logits — the head and the softmax over the vocabulary are most of a logit
step's cost on a small model. The loss of a layer is its relative squared error
``‖s − t‖² / ‖t‖²``, so layers with large residual streams do not dominate.
"""

from __future__ import annotations

import torch
from torch import nn

from deinfer_megatron.decompose.calibration import LayerRunner


def teacher_layer_io(teacher: nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) hidden states of every teacher layer on ``ids``."""
    runner = LayerRunner(teacher)
    with torch.no_grad():
        hidden = runner.embed(ids)
        io = []
        for index in range(len(runner.layers)):
            out = runner.run_layer(index, hidden)
            io.append((hidden, out))
            hidden = out
    return io


def block_loss(student: nn.Module, io: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Mean over layers of the relative squared error of each student layer on the teacher's input."""
    runner = LayerRunner(student)
    losses = []
    for index, (inp, target) in enumerate(io):
        out = runner.run_layer(index, inp)
        losses.append((out.float() - target.float()).pow(2).mean() / target.float().pow(2).mean())
    return torch.stack(losses).mean()
