"""The memory check counts a prefill's activations: by the formula below, from the shapes of the
model alone, and a job refused for its prefill fits once ``--max-prefill-tokens`` is lowered."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deinfer_megatron.checkpoints.folder import open_config
from deinfer_megatron.generation.job import GenerateJob, Generation
from deinfer_megatron.generation.prefill import largest_forward_rows
from deinfer_megatron.planning import preflight
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.planning.preflight import MemoryBudget
from deinfer_megatron.specs.layout import Layout

DEINFER, DENSE = Layout.DEINFER, Layout.DENSE


def _budget(arch, ranks, footprint, available: int) -> MemoryBudget:
    return MemoryBudget(arch, ranks, 1, 1, 4, footprint, available=available)


def _footprint(job: GenerateJob, prompts: list[list[int]], arch) -> preflight.Footprint:
    return Generation(job, tuple(map(tuple, prompts))).footprint(arch)
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
        totals = make_plan(arch, ranks, DENSE, tp=tp).totals
        attention = (heads + 2 * kv) * d // tp + h
        mlp = 2 * f // tp + h
        assert totals["activation_elements_per_token"] == 2 * h + max(attention, mlp), tp
        assert totals["score_heads"] == 2 * heads // tp, tp
    deinfer = make_plan(arch, ranks, DEINFER, tp=1).totals
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
    whole_fp, chunked_fp = _footprint(whole, prompts, arch), _footprint(chunked, prompts, arch)
    need_whole = _budget(arch, ranks, whole_fp, 1 << 60).check(DEINFER)
    need_chunked = _budget(arch, ranks, chunked_fp, 1 << 60).check(DEINFER)
    totals = make_plan(arch, ranks, DEINFER).totals
    per_row = preflight.ACTIVATION_FACTOR * totals["activation_elements_per_token"] * 4
    assert abs((need_whole - need_chunked) - (2000 - 64) * per_row) <= 1
    between = (need_whole + need_chunked) // 2
    with pytest.raises(ValueError, match="GiB of activations in the largest forward.*lower --max-prefill-tokens") as err:
        _budget(arch, ranks, whole_fp, between).check(DEINFER)
    assert "\n" not in str(err.value)
    _budget(arch, ranks, chunked_fp, between).check(DEINFER)


def test_logits_are_counted_by_hand(folder) -> None:
    """Every rank gathers the whole (padded) vocabulary's logits and copies them transposed,
    its own shard alive beside them under TP; a perplexity pass holds every row's logits and
    one more window's, generation only each sequence's last row."""
    from deinfer_megatron.evaluation.perplexity import PerplexityJob

    arch, ranks = open_config(folder, verify=False)
    v = arch.vocab_size
    padded = v + v % 2  # Megatron's rows split evenly over TP=2
    assert make_plan(arch, ranks, DENSE, tp=1).totals["logit_elements_per_token"] == 2 * v
    assert make_plan(arch, ranks, DENSE, tp=2).totals["logit_elements_per_token"] == 2 * padded + padded // 2
    def logits_bytes(footprint: preflight.Footprint) -> int:
        return (_budget(arch, ranks, footprint, 1 << 60).check(DEINFER)
                - _budget(arch, ranks, replace(footprint, logit_rows=0), 1 << 60).check(DEINFER))

    job = PerplexityJob(folder, "t.txt", max_tokens=512, window=64, batch=4)
    assert logits_bytes(job.footprint(arch)) == 2 * v * (4 * 64 + 64) * 4
    prompts = [[5] * 100] * 3
    assert logits_bytes(_footprint(GenerateJob(folder, ("",), max_new_tokens=4), prompts, arch)) == 2 * v * 3 * 4
