"""Healing data: token windows from text files and from conversations the teacher writes.

All sources are cut into ``[n, seq_len]`` windows and pooled. The order is a fixed function of
the seed — epoch ``e`` visits the windows in ``randperm(n, seed + e)`` — so step ``s`` always
sees the same batch, and a resumed run sees exactly what the uninterrupted run would have.
The pooled windows are saved with the run's state, so a resume does not sample the teacher
again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deinfer_megatron.decompose.calibration import self_dialogues, text_windows


@dataclass
class HealData:
    """Pooled token windows and where they came from (for the manifest)."""

    windows: torch.Tensor  # [n, seq_len] token ids
    sources: list[dict[str, Any]] = field(default_factory=list)

    def batch(self, step: int, batch: int, seed: int) -> torch.Tensor:
        """The ``batch`` windows of ``step`` (epochs reshuffled deterministically)."""
        n = self.windows.shape[0]
        rows = []
        for k in range(step * batch, (step + 1) * batch):
            epoch, i = divmod(k, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
            rows.append(order[i])
        return self.windows[torch.stack(rows)]


def build_data(tokenizer: Any, teacher: torch.nn.Module, texts: tuple[Path, ...], self_n: int | None, *,
               seq_len: int, max_text_tokens: int, seed: int) -> HealData:
    """Windows of every text file (at most ``max_text_tokens`` each) and ``self_n`` windows of
    teacher-written conversations."""
    parts, sources = [], []
    for path in texts:
        ids = text_windows(tokenizer, path, seq_len=seq_len, max_tokens=max_text_tokens)
        parts.append(ids)
        sources.append({"text": str(path), "tokens": ids.numel()})
    if self_n:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--calib-self needs a tokenizer with a chat template (the teacher writes "
                             "conversations in it); use --calib-text for this model")
        ids = self_dialogues(teacher, tokenizer, n=self_n, seq_len=seq_len, seed=seed)
        parts.append(ids)
        sources.append({"self_dialogues": self_n, "tokens": ids.numel()})
    return HealData(torch.cat(parts), sources)
