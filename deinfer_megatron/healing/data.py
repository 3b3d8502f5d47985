"""Healing data: token windows from text files and from conversations the teacher writes.

Every source (each text file; the teacher's conversations) is cut into ``[n, seq_len]``
windows, and the sources take turns — window ``k`` of the run comes from source
``k mod S`` — so a few hundred tokens of conversations are not drowned by a novel of 200k
(a model healed on prose alone forgets its chat format). With weights (``heal --source-weights``,
Megatron's ``--data-path W1 P1 W2 P2`` blend in spirit) the turns follow a smooth weighted
round robin instead: source ``j`` supplies ``w_j / Σw`` of every stretch of windows, as evenly
spread as integers allow; equal weights give exactly the plain ``k mod S`` turns. Within a source
the order is a fixed function of the seed — its epoch ``e`` visits the windows in
``randperm(n, seed + e)`` — so step ``s`` always sees the same batch, and a resumed run sees
exactly what the uninterrupted run would have. The windows (and weights) are saved with the run's
state, so a resume does not sample the teacher again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deinfer_megatron.decompose.calibration import SELF_TEMPERATURE, self_dialogues, text_windows


@dataclass
class HealData:
    """Pooled token windows and where they came from (for the manifest)."""

    windows: list[torch.Tensor]  # per source, [n_j, seq_len] token ids
    sources: list[dict[str, Any]] = field(default_factory=list)
    weights: list[float] | None = None  # per source, relative; None: equal turns
    _turns: list[tuple[int, int]] = field(default_factory=list, init=False, repr=False, compare=False)
    _round: dict[str, list] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def count(self) -> int:
        return sum(w.shape[0] for w in self.windows)

    def batch(self, step: int, batch: int, seed: int) -> torch.Tensor:
        """The ``batch`` windows of ``step`` (sources in turn, epochs reshuffled deterministically)."""
        rows = []
        for k in range(step * batch, (step + 1) * batch):
            j, visit = self.turn(k)
            n = self.windows[j].shape[0]
            epoch, i = divmod(visit, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1000 * j + epoch))
            rows.append(self.windows[j][order[i]])
        return torch.stack(rows)

    def turn(self, k: int) -> tuple[int, int]:
        """Window ``k`` of the run: (its source, how many windows that source gave before it)."""
        if self.weights is None:
            return k % len(self.windows), k // len(self.windows)
        if not self._round:
            self._round.update(credit=[0.0] * len(self.windows), given=[0] * len(self.windows))
        credit, given, total = self._round["credit"], self._round["given"], sum(self.weights)
        while len(self._turns) <= k:  # smooth weighted round robin, extended as far as asked
            for i, w in enumerate(self.weights):
                credit[i] += w
            j = max(range(len(credit)), key=lambda i: (credit[i], -i))  # ties: the earlier source
            credit[j] -= total
            self._turns.append((j, given[j]))
            given[j] += 1
        return self._turns[k]


def build_data(tokenizer: Any, teacher: torch.nn.Module, texts: tuple[Path, ...], self_n: int | None, *,
               seq_len: int, max_text_tokens: int, seed: int, weights: tuple[float, ...] = (),
               temperature: float = SELF_TEMPERATURE, answers: str = "sampled") -> HealData:
    """Windows of every text file (at most ``max_text_tokens`` each) and ``self_n`` windows of
    teacher-written conversations sampled at ``temperature`` (their answers ``answers``: sampled
    or greedy); ``weights`` (one per source in that order, or none for equal turns) blend them."""
    parts, sources = [], []
    for path in texts:
        ids = text_windows(tokenizer, path, seq_len=seq_len, max_tokens=max_text_tokens)
        parts.append(ids)
        sources.append({"text": str(path), "tokens": ids.numel()})
    if self_n:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--calib-self needs a tokenizer with a chat template (the teacher writes "
                             "conversations in it); use --calib-text for this model")
        ids = self_dialogues(teacher, tokenizer, n=self_n, seq_len=seq_len, seed=seed, temperature=temperature,
                             answers=answers)
        parts.append(ids)
        sources.append({"self_dialogues": self_n, "tokens": ids.numel(), "temperature": temperature}
                       | ({"answers": answers} if answers != "sampled" else {}))
    for source, weight in zip(sources, weights):
        source["weight"] = weight
    return HealData(parts, sources, list(weights) if weights else None)
