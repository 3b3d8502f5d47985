"""The memory check counts a prefill's activations: by the formula below, from the shapes of the
model alone, and a job refused for its prefill fits once ``--max-prefill-tokens`` is lowered."""

from __future__ import annotations

import pytest

from deinfer_megatron.checkpoints.folder import open_config
from deinfer_megatron.generation.job import GenerateJob, memory_sizes
from deinfer_megatron.generation.prefill import largest_forward_rows
from deinfer_megatron.planning import preflight
from deinfer_megatron.planning.plan import make_plan
from tests.helpers.tiny_models import full_rank_folders


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return full_rank_folders(tmp_path_factory.mktemp("preflight"))[2]


def test_activation_count_by_hand(folder) -> None:
    """Dense layout, TP=1 and 2: the widest block of a LLaMA layer is its MLP (gate and up merged
    into one product of 2·f per rank, then down to h); Megatron's core keeps scores and
    probabilities of every local head."""
    arch, ranks = open_config(folder, verify=False)
    h, f, heads, kv, d = arch.hidden_size, arch.ffn_hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
    for tp in (1, 2):
        totals = make_plan(arch, ranks, "dense", tp=tp).totals
        attention = (heads + 2 * kv) * d // tp + h
        mlp = 2 * f // tp + h
        assert totals["activation_elements_per_token"] == 2 * h + max(attention, mlp), tp
        assert totals["score_heads"] == 2 * heads // tp, tp
    deinfer = make_plan(arch, ranks, "deinfer", tp=1).totals
    assert deinfer["score_heads"] == 0, "the project's SDPA core streams its scores"


def test_largest_forward_is_the_biggest_chunk() -> None:
    assert largest_forward_rows(32, 2048, 8192) == 8192
    assert largest_forward_rows(32, 100, 8192) == 3200, "a short prompt goes whole"
    assert largest_forward_rows(3, 50, 8) == 6
    assert largest_forward_rows(64, 10, 8) == 64, "at least one position of every row"


def test_a_prefill_too_large_is_refused_and_a_smaller_chunk_fits(folder) -> None:
    arch, ranks = open_config(folder, verify=False)
    prompts = [[5] * 500] * 4
    whole = GenerateJob(folder, ("",), max_new_tokens=4, max_prefill_tokens=4 * 500)
    chunked = GenerateJob(folder, ("",), max_new_tokens=4, max_prefill_tokens=64)
    sizes = dict(tp=1, pp=1, dtype_bytes=4, available=1 << 60)
    need_whole = preflight.check_fits(arch, ranks, "deinfer", **sizes, **memory_sizes(whole, prompts))
    need_chunked = preflight.check_fits(arch, ranks, "deinfer", **sizes, **memory_sizes(chunked, prompts))
    totals = make_plan(arch, ranks, "deinfer").totals
    per_row = preflight.ACTIVATION_FACTOR * totals["activation_elements_per_token"] * 4
    assert abs((need_whole - need_chunked) - (2000 - 64) * per_row) <= 1
    between = (need_whole + need_chunked) // 2
    with pytest.raises(ValueError, match="GiB of activations in the largest forward.*lower --max-prefill-tokens") as err:
        preflight.check_fits(arch, ranks, "deinfer", **{**sizes, "available": between}, **memory_sizes(whole, prompts))
    assert "\n" not in str(err.value)
    preflight.check_fits(arch, ranks, "deinfer", **{**sizes, "available": between}, **memory_sizes(chunked, prompts))


def test_logits_are_counted_by_hand(folder) -> None:
    """Every rank gathers the whole (padded) vocabulary's logits and copies them transposed,
    its own shard alive beside them under TP; a perplexity pass holds every row's logits and
    one more window's, generation only each sequence's last row."""
    from deinfer_megatron.evaluation.perplexity import PerplexityJob, forward_sizes

    arch, ranks = open_config(folder, verify=False)
    v = arch.vocab_size
    padded = v + v % 2  # Megatron's rows split evenly over TP=2
    assert make_plan(arch, ranks, "dense", tp=1).totals["logit_elements_per_token"] == 2 * v
    assert make_plan(arch, ranks, "dense", tp=2).totals["logit_elements_per_token"] == 2 * padded + padded // 2
    sizes = dict(tp=1, pp=1, dtype_bytes=4, available=1 << 60)

    def logits_bytes(**forward) -> int:
        return (preflight.check_fits(arch, ranks, "deinfer", **sizes, **forward)
                - preflight.check_fits(arch, ranks, "deinfer", **sizes, **{**forward, "logit_rows": 0}))

    job = PerplexityJob(folder, "t.txt", max_tokens=512, window=64, batch=4)
    assert logits_bytes(**forward_sizes(job)) == 2 * v * (4 * 64 + 64) * 4
    prompts = [[5] * 100] * 3
    assert logits_bytes(**memory_sizes(GenerateJob(folder, ("",), max_new_tokens=4), prompts)) == 2 * v * 3 * 4
