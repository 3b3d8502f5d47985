"""Running a forward pass across pipeline stages with point-to-point send/recv.

Megatron's pipeline schedules are built for training and need CUDA; inference only needs each
stage to receive the previous stage's hidden states, run its layers, and pass them on. Every
rank knows the token ids (they are the same on all ranks), hence the shape it will receive.
Inputs are moved to the stage's device and buffers are allocated there, so callers may hand in
CPU token ids whatever the device; logits come back on the stage's device.
"""

from __future__ import annotations

from typing import Any

import torch

from deinfer_megatron.models.build import Stage
from deinfer_megatron.parallel import comm


def stage_forward(
    stage: Stage,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    inference_context: Any = None,
) -> torch.Tensor | None:
    """Run this stage on ``input_ids [b, s]``.

    Returns the logits ``[b, s, vocab]`` (vocabulary padding removed, on ``stage.device``) on
    the last stage and None on the others, which send their hidden states ``[s, b, h]`` to the
    next stage.
    """
    groups = stage.groups
    model = stage.driver
    input_ids, position_ids = input_ids.to(stage.device), position_ids.to(stage.device)
    if attention_mask is not None:
        attention_mask = attention_mask.to(stage.device)
    if not groups.is_first_stage:
        b, s = input_ids.shape
        hidden = comm.recv_from((s, b, stage.arch.hidden_size), stage.model.config.params_dtype,
                                stage.device, groups.prev_rank)
        stage.model.set_input_tensor(hidden)
    with torch.inference_mode():
        out = model(
            input_ids if groups.is_first_stage else None,
            position_ids,
            attention_mask,
            inference_context=inference_context,
            runtime_gather_output=True,  # Megatron's inference path needs the full vocabulary
        )
    if not groups.is_last_stage:
        comm.send_to(out, groups.next_rank)
        return None
    return out[..., : stage.arch.vocab_size]


def broadcast_from_last_stage(stage: Stage, tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Give every rank the last stage's ``tensor`` (shape and dtype of ``like``), on the
    stage's device."""
    groups = stage.groups
    if groups.pp_size == 1:
        assert tensor is not None, "a single stage is the last stage"
        return tensor
    buf = tensor.to(stage.device) if groups.is_last_stage else torch.empty_like(like, device=stage.device)
    return comm.broadcast_from(buf, groups.last_stage_rank, groups.pg_collection.pp)
