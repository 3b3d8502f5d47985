"""Choosing the next token: greedy, or temperature / top-k / top-p sampling.

Every rank that samples uses a generator seeded identically and the same logits (they are
gathered over TP), so all ranks draw the same tokens without communicating.
"""

from __future__ import annotations

import math
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
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0 to sample (0 means greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be ≥ 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:  # also false for NaN
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")

    @classmethod
    def from_options(cls, *, temperature: float | None = None, top_k: int = 0, top_p: float = 1.0,
                     seed: int = 0, greedy: bool = False) -> "SamplingParams":
        """What the command-line (and OpenAI-style) options mean: greedy unless a temperature,
        top-k or top-p asks for sampling; temperature 0 is greedy, as in every other tool."""
        if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"--temperature must be a number ≥ 0 (0 means greedy), got {temperature}")
        sampling = (temperature or 0) > 0 or top_k != 0 or top_p != 1.0
        if greedy and sampling:
            raise ValueError("--greedy cannot be combined with --temperature/--top-k/--top-p")
        if temperature == 0 or not sampling:
            cls(top_k=top_k, top_p=top_p)  # the range errors of top-k / top-p, even when unused
            return cls(greedy=True, seed=seed)
        return cls(greedy=False, temperature=1.0 if temperature is None else temperature,
                   top_k=top_k, top_p=top_p, seed=seed)


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
