"""Chunked prefill: a long batch of prompts goes through the model a few positions at a time.

A prefill forwards ``batch × prompt`` tokens at once, and every layer's activations scale with
that count — batch 32 × 2048 tokens is 65,536 rows of every hidden state, intermediate and
attention output, many times what the weights and the KV cache hold. The KV cache is filled position by
position anyway, so the prompt can be fed in chunks of positions: each chunk attends to the
cache written by the chunks before it and causally within itself, and only the last chunk's
logits are kept. Peak activation memory is then that of ``max_tokens`` rows, whatever the
prompt; the tokens are those of one whole forward (the same sums, in the same order per row).

The default, 2048 rows, is the fastest chunk measured on a llama-1b-shape prefill
(docs/BENCHMARKS.md, "Chunked prefill"): smaller chunks cost more passes over the weights,
larger ones fall out of the CPU's caches, and memory grows with the chunk.

Megatron's static path assumes that a forward after the first is a decode step and turns its
causal mask off (``Attention._adjust_key_value_for_inference``: ``sequence_len_offset > 0`` →
``AttnMaskType.no_mask``), so every chunk after the first carries an explicit mask; every
core attention here (the project's SDPA, Megatron's ``DotProductAttention``) applies a mask
it is given.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

DEFAULT_MAX_PREFILL_TOKENS = 2048  # rows per prefill forward: the fastest and among the leanest measured (module doc)


def check_max_tokens(max_tokens: int) -> int:
    """``max_tokens`` if usable, else a one-line error naming the option."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"--max-prefill-tokens must be a positive whole number of tokens, got {max_tokens!r}")
    return max_tokens


def chunk_width(batch: int, max_tokens: int) -> int:
    """Positions per chunk for ``batch`` sequences: ``max_tokens // batch``, at least one."""
    return max(1, check_max_tokens(max_tokens) // max(1, batch))


def chunk_bounds(start: int, end: int, batch: int, max_tokens: int) -> list[tuple[int, int]]:
    """Positions ``[start, end)`` cut into consecutive chunks of ``chunk_width`` positions (the
    last may be shorter): at most ``max_tokens`` rows each, unless one position is more."""
    width = chunk_width(batch, max_tokens)
    if end <= start:
        return []
    return [(s, min(end, s + width)) for s in range(start, end, width)]


def chunk_mask(start: int, end: int, device: torch.device | str) -> torch.Tensor | None:
    """The mask of positions ``[start, end)`` against keys ``[0, end)``: ``[1, 1, sq, end]``,
    True where masked out (Megatron's convention), i.e. the keys after each query. None for a
    chunk that starts the sequence, where the cores' own causal mask is right."""
    if start == 0:
        return None
    allowed = torch.ones(end - start, end, dtype=torch.bool, device=device).tril(start)
    return (~allowed).view(1, 1, end - start, end)


def chunked_forward(forward: Callable[[int, int, torch.Tensor | None], Any], start: int, end: int,
                    batch: int, max_tokens: int, device: torch.device | str) -> Any:
    """Call ``forward(chunk_start, chunk_end, mask)`` for each chunk of ``[start, end)`` in order
    (each call advances the cache by its positions); the last call's result is returned."""
    out = None
    for lo, hi in chunk_bounds(start, end, batch, max_tokens):
        out = forward(lo, hi, chunk_mask(lo, hi, device))
    return out


class ChunkedPrefillWrapper(GPTInferenceWrapper):
    """Megatron's ``GPTInferenceWrapper`` whose forward step feeds at most ``max_tokens`` rows at
    a time (the static controller's prefill, which would otherwise forward every prompt
    position at once), with or without pipeline stages: each chunk is one of Megatron's own
    forward steps. Decode steps (one position) pass straight through.

    Megatron offers ``inference_batch_times_seqlen_threshold`` for a large prefill, but only
    under pipeline parallelism, and it splits the batch (the cache is then written by batch
    offset); this splits positions, which any layout's cache already supports.
    """

    def __init__(self, model: Any, config: Any, inference_context: Any, *, max_tokens: int) -> None:
        super().__init__(model, config, inference_context=inference_context)
        self.max_tokens = check_max_tokens(max_tokens)

    def run_one_forward_step(self, inference_input: dict[str, Any],
                             recv_buffer_seq_len: int | None = None) -> torch.Tensor:
        tokens, positions = inference_input["tokens"], inference_input["position_ids"]
        batch, length = tokens.shape
        if (batch * length <= self.max_tokens or recv_buffer_seq_len is not None
                or self.inference_context.sequence_len_offset != 0):
            return super().run_one_forward_step(inference_input, recv_buffer_seq_len)
        full = inference_input["attention_mask"]  # [1, 1, s, s] from Megatron's local backend, or None

        def forward(lo: int, hi: int, mask: torch.Tensor | None) -> torch.Tensor:
            chunk = {"tokens": tokens[:, lo:hi], "position_ids": positions[:, lo:hi],
                     "attention_mask": mask if full is None else full[..., lo:hi, :hi]}
            return super(ChunkedPrefillWrapper, self).run_one_forward_step(chunk)

        return chunked_forward(forward, 0, length, batch, self.max_tokens, tokens.device)


def largest_forward_rows(batch: int, shortest_prompt: int, max_tokens: int) -> int:
    """Token rows of a generation's largest forward: its prefill's biggest chunk (the prefill
    runs to the shortest prompt; later positions go one per step)."""
    return batch * min(shortest_prompt, chunk_width(batch, max_tokens))
