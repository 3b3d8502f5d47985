"""bfloat16 references from Hugging Face transformers for a tiny model: how far bfloat16 itself
moves its logits, and prompts whose greedy continuation bfloat16 rounding cannot flip.

bfloat16 keeps 8 significant bits. A TP rank's partial sums, a factor pair's two products and
Megatron's fused kernels round in other places and orders than transformers' dense model, so
the project's bfloat16 logits may differ from transformers' bfloat16 ones by a few times the
amount bfloat16 moves them at all (transformers' bfloat16 logits against its float32 ones:
``bf16_error``). A wrong weight, a missed bias or a cache read in the wrong dtype moves them by
the logits' own scale. Where the top two logits of a step are further apart than twice the
tolerance, every implementation within it picks the same token; the random tiny models have many
near-ties, so the greedy checks use prompts whose every step is decided by more (``decided``).
"""

from __future__ import annotations

import torch

TOLERANCE = 3.0  # × bf16_error: the largest logit difference allowed against transformers' bfloat16


def bf16_error(hf32: torch.nn.Module, hf16: torch.nn.Module, *, rows: int = 16, length: int = 6,
               seed: int = 1) -> float:
    """Largest |logit| difference between the bfloat16 and float32 copies of one model, over
    ``rows`` seeded random prompts of ``length`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, hf32.config.vocab_size, (rows, length), generator=gen)
    with torch.no_grad():
        return (hf16(ids).logits.float() - hf32(ids).logits).abs().max().item()


def decided(hf16: torch.nn.Module, tolerance: float, *, count: int = 3, length: int = 6, new: int = 6,
            pool: int = 300, seed: int = 0) -> torch.Tensor:
    """``[≤ count, length + new]``: random prompts of ``length`` tokens (seeded, from a pool of
    ``pool``) with transformers' bfloat16 greedy continuation, kept where every one of the ``new``
    steps has its top-1 logit more than ``2 × tolerance`` above the second."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, hf16.config.vocab_size, (pool, length), generator=gen)
    chosen: list[torch.Tensor] = []
    for chunk in prompts.split(60):
        with torch.no_grad():
            g = hf16.generate(chunk, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)
        top = torch.stack(g.scores, 1).float().topk(2, -1).values  # [prompts, steps, 2]
        margin = (top[..., 0] - top[..., 1]).amin(1)
        chosen += [g.sequences[i] for i in range(len(chunk)) if margin[i] > 2 * tolerance]
        if len(chosen) >= count:
            break
    assert len(chosen) >= 2, f"only {len(chosen)} of {pool} prompts have greedy margins above {2 * tolerance:.3g}"
    return torch.stack(chosen[:count])
