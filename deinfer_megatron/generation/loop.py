"""The project's generation loop: prefill, then one token per step, on any TP/PP layout.

Prompts of different lengths are handled the way Megatron's static engine does: the batch is
right-padded, prefill runs up to the shortest prompt, and every later step feeds one token per
row — the row's next prompt token while it is still inside its prompt, its sampled token after.
All rows then share positions, so no padding mask is needed and the tokens equal one-at-a-time
generation. The last pipeline stage samples; the tokens are broadcast to the other stages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from deinfer_megatron.generation.context import GenerationContext
from deinfer_megatron.generation.prefill import DEFAULT_MAX_PREFILL_TOKENS, chunked_forward
from deinfer_megatron.generation.sampling import SamplingParams, sample
from deinfer_megatron.models.build import Stage
from deinfer_megatron.models.pipeline import broadcast_from_last_stage, stage_forward

StopCheck = Callable[[int, list[int]], bool]  # (row, generated ids) → stop now?
OnToken = Callable[[int, int], None]  # (row, token id) as it is generated


@dataclass
class Generated:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos" | "length" | "stop"


@dataclass
class Timing:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def _forward(stage: Stage, tokens: torch.Tensor, start: int, context: GenerationContext,
             mask: torch.Tensor | None = None) -> torch.Tensor | None:
    pos = torch.arange(start, start + tokens.shape[1], device=tokens.device).expand_as(tokens)
    logits = stage_forward(stage, tokens, pos, attention_mask=mask, inference_context=context)
    context.sequence_len_offset += tokens.shape[1]
    return None if logits is None else logits[:, -1]


def _next_tokens(stage: Stage, logits: torch.Tensor | None, batch: int, params: SamplingParams,
                 generator: torch.Generator) -> list[int]:
    """The next token of every row, on every rank: sampled on the last stage, then broadcast."""
    chosen = sample(logits, params, generator) if logits is not None else None
    like = torch.zeros(batch, dtype=torch.long, device=generator.device)
    return broadcast_from_last_stage(stage, chosen, like).tolist()


def generate_tokens(
    stage: Stage,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    params: SamplingParams,
    context: GenerationContext,
    eos_ids: frozenset[int] = frozenset(),
    stop: StopCheck | None = None,
    on_token: OnToken | None = None,
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
) -> tuple[list[Generated], Timing]:
    """Generate for every prompt (token ids); identical on every rank. The prefill forwards at
    most ``max_prefill_tokens`` rows at a time (``prefill.py``)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    total = max(lengths) + max_new_tokens
    device = stage.device
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = torch.tensor(list(p), device=device)
    outputs = [Generated(list(p)) for p in prompts]
    generator = torch.Generator(device=device).manual_seed(params.seed)
    timing = Timing()
    context.reset()

    start = min(lengths)
    t0 = time.perf_counter()
    logits = chunked_forward(lambda lo, hi, mask: _forward(stage, tokens[:, lo:hi], lo, context, mask),
                             0, start, batch, max_prefill_tokens, device)
    timing.prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for step in range(start, total):
        chosen = _next_tokens(stage, logits, batch, params, generator)
        for row, out in enumerate(outputs):
            if step < lengths[row]:
                continue  # still inside its prompt: keep the prompt token
            if out.finish_reason is None:
                token = chosen[row]
                tokens[row, step] = token
                out.token_ids.append(token)
                timing.decode_tokens += 1
                if on_token is not None:
                    on_token(row, token)
                if token in eos_ids:
                    out.finish_reason = "eos"
                elif stop is not None and stop(row, out.token_ids):
                    out.finish_reason = "stop"
                elif len(out.token_ids) >= max_new_tokens:
                    out.finish_reason = "length"
        if all(o.finish_reason for o in outputs) or step + 1 == total:
            break
        logits = _forward(stage, tokens[:, step : step + 1], step, context)
    timing.decode_s = time.perf_counter() - t0
    for out in outputs:
        out.finish_reason = out.finish_reason or "length"
    return outputs, timing
