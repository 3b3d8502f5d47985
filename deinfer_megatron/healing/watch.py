"""Held-out perplexity during healing (``--eval-text``): the curve of perplexity against
healing tokens and minutes, measured on the model being trained.

The student is evaluated in place (no gradient) on fixed windows of each file, through the
logits its ``healing.student.Student`` gives; the time it takes is not counted in the healing
budget or in the reported minutes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from deinfer_megatron.decompose.calibration import text_windows


class HeldOut:
    """Fixed ``[n, window]`` token windows of each evaluation file."""

    def __init__(self, tokenizer: Any, texts: tuple[Path, ...], *, window: int, max_tokens: int) -> None:
        self.windows = {Path(t).name: text_windows(tokenizer, t, seq_len=window, max_tokens=max_tokens)
                        for t in texts}

    def perplexity_of(self, logits_fn: Callable[[torch.Tensor], torch.Tensor], batch: int = 4) -> dict[str, float]:
        """Perplexity on every file of the model whose ``[b, s, vocab]`` logits ``logits_fn``
        computes from ``[b, s]`` ids (on TP×PP ranks: a collective every rank calls)."""
        out = {}
        with torch.no_grad():
            for name, windows in self.windows.items():
                nll, count = 0.0, 0
                for ids in windows.split(batch):
                    logits = logits_fn(ids)[:, :-1].float()
                    nll += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
                    count += ids[:, 1:].numel()
                out[name] = math.exp(nll / count)
        return out
