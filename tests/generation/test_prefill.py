"""Chunked prefill: a prompt fed a few positions per forward gives Hugging Face's logits.

The reference is the dense Hugging Face model's forward over the whole prompt (and over the
prompt plus one token, for the decode step that reads the cache the chunks wrote). A chunk
that saw the keys after its queries, or a cache written at the wrong offset, changes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
from deinfer_megatron.generation.prefill import check_max_tokens, chunk_bounds, chunk_mask
from deinfer_megatron.specs.layout import Layout
from tests.helpers.distributed import run_ranks
from tests.helpers.tiny_models import full_ranks, save_tiny_folder

PROMPT_LEN, BATCH = 11, 3


def test_chunk_bounds_cover_the_positions_in_order() -> None:
    assert chunk_bounds(0, 11, 3, 9) == [(0, 3), (3, 6), (6, 9), (9, 11)]
    assert chunk_bounds(0, 5, 8, 4) == [(i, i + 1) for i in range(5)], "at least one position per chunk"
    assert chunk_bounds(0, 7, 2, 100) == [(0, 7)]
    assert chunk_bounds(4, 4, 2, 8) == []


def test_chunk_mask_hides_exactly_the_later_keys() -> None:
    assert chunk_mask(0, 5, "cpu") is None
    mask = chunk_mask(3, 6, "cpu")[0, 0]
    for q, pos in enumerate(range(3, 6)):
        assert mask[q].tolist() == [k > pos for k in range(6)]


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "8"])
def test_a_bad_budget_is_one_line(bad) -> None:
    with pytest.raises(ValueError, match="--max-prefill-tokens must be a positive whole number") as err:
        check_max_tokens(bad)
    assert "\n" not in str(err.value)


def _prefill_logits(model: str, prompts: list[list[int]], budget: int) -> dict[str, list]:
    """Last-position logits after a chunked prefill, and after one decode step, per layout,
    cache and driver (the project's loop; Megatron's wrapper as its controller calls it)."""
    from deinfer_megatron.generation.context import GenerationContext
    from deinfer_megatron.generation.loop import _forward
    from deinfer_megatron.generation.megatron_engine import _wrapper_config
    from deinfer_megatron.generation.prefill import ChunkedPrefillWrapper, chunked_forward
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown

    groups = init_parallel(1, 1)
    tokens = torch.tensor(prompts)
    b, s = tokens.shape
    out: dict[str, list] = {}
    try:
        for layout, kv in (("deinfer", "full"), ("deinfer", "latent"), ("naive", "full"), ("dense", "full")):
            stage = load_folder(Path(model), Layout(layout), groups)
            ctx = GenerationContext(b, s + 1, kv_cache=kv)
            ctx.reset()
            first = chunked_forward(lambda lo, hi, m: _forward(stage, tokens[:, lo:hi], lo, ctx, m),
                                    0, s - 1, b, budget, "cpu")
            last = _forward(stage, tokens[:, s - 1:], s - 1, ctx)
            out[f"{layout}/{kv}/loop"] = [first.tolist(), last.tolist()]

            ctx = GenerationContext(b, s + 1, kv_cache=kv)
            wrapper = ChunkedPrefillWrapper(stage.model, _wrapper_config(stage, ctx), ctx, max_tokens=budget)
            wrapper.prep_model_for_inference()
            data = wrapper.prep_inference_input(tokens)
            first = wrapper.run_one_forward_step(wrapper.get_batch_for_context_window(data, 0, s - 1))
            last = wrapper.run_one_forward_step(wrapper.get_batch_for_context_window(data, s - 1, s))
            vocab = stage.arch.vocab_size
            out[f"{layout}/{kv}/engine"] = [first[:, -1, :vocab].tolist(), last[:, -1, :vocab].tolist()]
    finally:
        shutdown()
    return out


def test_chunked_prefill_gives_hugging_face_logits(tmp_path: Path) -> None:
    hf = save_tiny_folder("llama", tmp_path / "dense")
    (tmp_path / "ranks.json").write_text(json.dumps(full_ranks(hf)))
    model = run_decompose(DecomposeJob(tmp_path / "dense", "svd", rank_config=tmp_path / "ranks.json",
                                       out=tmp_path / "full"))
    prompts = torch.randint(3, hf.config.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(prompts).logits
    expected = [want[:, PROMPT_LEN - 2], want[:, PROMPT_LEN - 1]]
    # 2 positions per chunk: prefill of 10 positions in 5 forwards, the last 4 with a mask
    results = run_ranks(1, _prefill_logits, str(model), prompts.tolist(), 2 * BATCH)[0]
    assert len(results) == 8
    for key, (prefill, decode) in results.items():
        for got, ref, what in ((prefill, expected[0], "prefill"), (decode, expected[1], "decode after it")):
            torch.testing.assert_close(torch.tensor(got), ref, atol=2e-4, rtol=1e-4, msg=f"{key}: {what}")
