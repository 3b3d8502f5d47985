"""The distillation loss: KL from the teacher's next-token distribution, plus optional CE.

``KL(p_teacher || p_student)`` per token, averaged over tokens, is the forward KL a
distribution-matching student minimises (it puts mass wherever the teacher does). The
optional cross-entropy on the text's own next tokens pulls towards the data as well. The
top-k pair (``teacher_topk``, ``topk_kl``) is the same KL against a teacher stored once as its
k most likely tokens, measured against the in-ranks teacher by ``scripts/heal_teacher_compare.py``.
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


# ------------------------------------------------------------------ a precomputed teacher (top-k)
# Not a ``heal`` option yet: ``scripts/heal_teacher_compare.py`` measures whether storing the
# teacher's top-k once beats running the teacher in the ranks every step (docs/HEALING.md).

TAILS = ("bucket", "renorm")


def teacher_topk(teacher_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a precomputed teacher stores per token: its ``k`` most likely next tokens' log-probabilities
    (normalised over the full vocabulary, float32 ``[..., k]``), their ids (int32 ``[..., k]``) and the
    log of the mass left on the other tokens (float32 ``[...]``; ``-inf`` when ``k`` is the vocabulary)."""
    logp = F.log_softmax(teacher_logits.float(), dim=-1)
    values, ids = logp.topk(k, dim=-1)
    tail = logp.scatter(-1, ids, float("-inf")).logsumexp(-1)
    return values, ids.to(torch.int32), tail


def topk_kl(student_logits: torch.Tensor, top_logp: torch.Tensor, top_ids: torch.Tensor,
            tail_logp: torch.Tensor, tail: str = "bucket") -> torch.Tensor:
    """Mean over tokens of the KL from a stored top-k teacher (:func:`teacher_topk`) to the student.

    ``bucket``: the teacher's k tokens plus one bucket for all the others, against the student's
    probabilities of the same k tokens and of the rest (the student's full softmax). It is the KL
    of the full distributions with the tail tokens merged, so it never exceeds :func:`token_kl`,
    equals it when ``k`` is the vocabulary, and still charges a student that moves mass into the
    tail. ``renorm``: both distributions renormalised over the teacher's k tokens (the tail
    ignored: a student is not charged for mass outside them).
    """
    if tail not in TAILS:
        raise ValueError(f"unknown tail handling {tail!r}; choose one of {', '.join(TAILS)}")
    s = F.log_softmax(student_logits.float(), dim=-1)
    ids = top_ids.long()
    s_top = s.gather(-1, ids)
    if tail == "renorm":
        t = top_logp - top_logp.logsumexp(-1, keepdim=True)
        q = s_top - s_top.logsumexp(-1, keepdim=True)
        return (t.exp() * (t - q)).sum(-1).mean()
    kl = (top_logp.exp() * (top_logp - s_top)).sum(-1)
    has_tail = torch.isfinite(tail_logp)
    s_tail = s.scatter(-1, ids, float("-inf")).logsumexp(-1)
    # the teacher's empty tail (k = vocabulary) adds nothing; zeros in place of the -inf keep its gradient finite
    t_tail = torch.where(has_tail, tail_logp, torch.zeros_like(tail_logp))
    s_tail = torch.where(has_tail, s_tail, torch.zeros_like(s_tail))
    return (kl + torch.where(has_tail, t_tail.exp() * (t_tail - s_tail), torch.zeros_like(kl))).mean()
