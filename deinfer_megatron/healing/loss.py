"""The distillation loss: KL from the teacher's next-token distribution, plus optional CE.

``KL(p_teacher || p_student)`` per token, averaged over tokens, is the forward KL a
distribution-matching student minimises (it puts mass wherever the teacher does). The
optional cross-entropy on the text's own next tokens pulls towards the data as well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``KL(softmax(teacher) || softmax(student))`` ([..., vocab] inputs)."""
    s = F.log_softmax(student_logits.float(), dim=-1).flatten(0, -2)
    t = F.log_softmax(teacher_logits.float(), dim=-1).flatten(0, -2)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, ids: torch.Tensor,
                 ce_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """KL (+ ``ce_weight`` × next-token CE); returns the loss and its parts."""
    kl = token_kl(student_logits, teacher_logits)
    parts = {"kl": kl.item()}
    loss = kl
    if ce_weight:
        ce = F.cross_entropy(student_logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        parts["ce"] = ce.item()
        loss = loss + ce_weight * ce
    return loss, parts
