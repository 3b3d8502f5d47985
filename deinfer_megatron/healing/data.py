"""Healing data: token windows from text files and from conversations the teacher writes.

Every source (each text file; the teacher's conversations) is cut into ``[n, seq_len]``
windows, and the sources take turns — window ``k`` of the run comes from source
``k mod S`` — so a few hundred tokens of conversations are not drowned by a novel of 200k
(a model healed on prose alone forgets its chat format). Within a source the order is a fixed
function of the seed — its epoch ``e`` visits the windows in ``randperm(n, seed + e)`` — so
step ``s`` always sees the same batch, and a resumed run sees exactly what the uninterrupted
run would have. The windows are saved with the run's state, so a resume does not sample the
teacher again.
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

    windows: list[torch.Tensor]  # per source, [n_j, seq_len] token ids
    sources: list[dict[str, Any]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(w.shape[0] for w in self.windows)

    def batch(self, step: int, batch: int, seed: int) -> torch.Tensor:
        """The ``batch`` windows of ``step`` (sources in turn, epochs reshuffled deterministically)."""
        rows = []
        for k in range(step * batch, (step + 1) * batch):
            j, visit = k % len(self.windows), k // len(self.windows)
            n = self.windows[j].shape[0]
            epoch, i = divmod(visit, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1000 * j + epoch))
            rows.append(self.windows[j][order[i]])
        return torch.stack(rows)


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
    return HealData(parts, sources)
