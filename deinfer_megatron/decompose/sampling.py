"""A sampling loop for the model's own text (``--calib-self``): rows leave the batch when they end.

Transformers' ``generate`` keeps every row of a batch until the longest one is done, and draws
each token through ``torch.multinomial`` over the whole vocabulary. For the conversations the
teacher writes (one answer of 40 tokens beside one of 256) that is most of the time: measured on
2 cores, SmolLM2-135M writing 32 conversations took 269 s, two thirds of its rows padding by the
end of a round, and the draw alone 45 ms of a ~0.4 s step. Here a finished row's cache rows are
dropped (``DynamicCache.batch_select_indices``), so a step costs what the live rows cost, and a
token is drawn by inverting the cumulative distribution with one uniform number per row.

The distribution is the one ``generate`` samples with ``temperature=T, top_k=0, top_p=1``:
``softmax(logits / T)``; near zero it is greedy decoding (tests compare both with transformers).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def draw(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits [b, V]`` from ``softmax(logits / temperature)``: the first
    index whose cumulative probability exceeds a uniform number (scaled by the row's total, so
    rounding in the cumulative sum cannot push it past the last token). ``temperature`` 0 is
    greedy decoding: the likeliest token, no draw."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    cdf = probs.cumsum(-1)
    u = torch.rand(logits.shape[0], 1, generator=generator) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=logits.shape[-1] - 1).squeeze(-1)


def _step_kwargs(model: nn.Module, cache: Any) -> dict[str, Any]:
    """The cache under the name this transformers calls it (``cache`` from 5.x's later releases,
    ``past_key_values`` before), and only the last position's logits where the model can skip
    the others (the prompt's vocabulary projection is a GEMM of its own)."""
    params = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    return kwargs


@torch.no_grad()
def sample_rows(model: nn.Module, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                eos_id: int | None, generator: torch.Generator | None = None) -> list[list[int]]:
    """Continue every prompt (token ids) by sampling until it writes ``eos_id`` (kept at the end
    of its row) or ``max_new_tokens``; returns the new tokens of each row, prompts left-padded
    together and finished rows dropped from the batch as they end."""
    from transformers import DynamicCache

    width = max(len(p) for p in prompts)
    pad = 0 if eos_id is None else eos_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    cache = DynamicCache()
    step_kwargs = _step_kwargs(model, cache)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **step_kwargs)
    logits = out.logits[:, -1]
    live = torch.arange(len(prompts))  # which prompt each batch row continues
    written: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        token = draw(logits, temperature, generator)
        for row, t in zip(live.tolist(), token.tolist()):
            written[row].append(t)
        going = torch.ones_like(token, dtype=torch.bool) if eos_id is None else token != eos_id
        if step == max_new_tokens - 1 or not going.any():
            break
        if not going.all():
            keep = going.nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            live, token, mask = live[keep], token[keep], mask[keep]
        mask = torch.cat([mask, torch.ones(len(live), 1, dtype=mask.dtype)], dim=1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                    **step_kwargs)
        logits = out.logits[:, -1]
    return written
