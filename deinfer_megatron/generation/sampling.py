"""Choosing the next token: greedy, or temperature / top-k / top-p sampling.

Every rank that samples uses a generator seeded identically and the same logits (they are
gathered over TP), so all ranks draw the same tokens without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0 (use --greedy for argmax), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be ≥ 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """``[b, vocab]`` logits → ``[b]`` token ids."""
    logits = logits.float()
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
