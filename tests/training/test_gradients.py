"""Training the decomposed layers on real gloo ranks, against plain PyTorch in one process.

For tiny LLaMA (GQA), Qwen2 (QKV bias, tied embeddings, 2 KV heads: replicated at TP=4, where
every attention block is decomposed) and OPT (biases, learned positions, ReLU), with variadic
ranks and layer 1 dense, in the deinfer, naive and dense layouts at TP=1, 2, 4, PP=2 and
TP2×PP2 (float64):

* the gradient of every parameter (factors, dense weights, norms, embeddings) equals the
  gradient of a Hugging Face model with ``nn.Linear`` factor pairs (the dense layout: the
  multiplied-out model), cut to the rank's shard by the parameter's own loader;
* the backward collectives the ledger records per layer are ``plan``'s training column;
* three AdamW steps (warm-up + cosine, clipping, weight decay) give the losses and gradient
  norms of ``torch.optim.AdamW`` + ``clip_grad_norm_`` on the reference — the same at every
  size, which also shows that the gradient norm counts every parameter once;
* the zero padding of merged V factors stays zero through those steps.

One launch per world size (1, 2, 4) runs every parallel shape of that size, model and layout.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import Any

import pytest

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig
from tests.helpers.distributed import run_ranks
from tests.helpers.tiny_models import TINY_CONFIGS
from tests.helpers.training import BATCH, SEQ, case, reference_steps, training_worker

FAMILIES = ["llama", "qwen2", "opt"]
LAYOUTS = ["deinfer", "naive", "dense"]
SIZES = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]
STEPS = 3
GRAD_TOL = 1e-5  # relative to the gradient's norm (floor 1e-3: the K bias's is ~0 in exact maths)


@lru_cache(maxsize=None)
def _launch(world: int) -> list[dict]:
    """One launch per world size runs every (TP, PP) of that size."""
    sizes = [(tp, pp) for tp, pp in SIZES if tp * pp == world]
    return run_ranks(world, training_worker, sizes, FAMILIES, LAYOUTS, STEPS)


def run(tp: int, pp: int) -> list[dict[str, Any]]:
    return [rank[(tp, pp)] for rank in _launch(tp * pp)]


@lru_cache(maxsize=None)
def reference(family: str, tp: int, layout: str) -> list[tuple[float, float]]:
    c = case(family, tp)
    return reference_steps(c["dense"] if layout == "dense" else c["factored"], c["ids"], c["labels"], STEPS)


def _entries(tp: int, pp: int) -> dict[str, list[tuple[dict, dict]]]:
    out: dict[str, list] = {}
    for rank in run(tp, pp):
        for key, entry in rank["results"].items():
            out.setdefault(key, []).append((rank, entry))
    return out


@pytest.mark.parametrize("tp,pp", SIZES, ids=str)
def test_every_gradient_equals_the_factor_pair_reference(tp: int, pp: int) -> None:
    entries = _entries(tp, pp)
    expected_cases = len(FAMILIES) * len(LAYOUTS) - (1 if tp > 2 else 0)  # qwen2 dense: TP ≤ 2
    assert len(entries) == expected_cases
    for key, ranks in entries.items():
        assert len(ranks) == tp * pp
        for rank, entry in ranks:
            assert entry["errors"], key
            for name, (err, norm) in entry["errors"].items():
                assert err <= GRAD_TOL * max(norm, 1e-3), (key, rank["tp_rank"], rank["pp_rank"], name, err, norm)


@pytest.mark.parametrize("tp,pp", SIZES, ids=str)
def test_backward_collectives_are_the_plans_training_column(tp: int, pp: int) -> None:
    for key, ranks in _entries(tp, pp).items():
        family, layout = key.split("/")
        arch = arch_from_hf_config(TINY_CONFIGS[family])
        plan = make_plan(arch, RankConfig.from_mapping(ranks[0][1]["ranks"], arch), Layout(layout), tp=tp, pp=pp)
        per_stage = arch.num_layers // pp
        for rank, entry in ranks:
            offset = entry["layer_offset"]
            assert all(tokens == BATCH * SEQ for *_, tokens in entry["backward"]), key
            for index in range(offset, offset + per_stage):
                got = Counter((kind, el) for n, kind, el, _ in entry["backward"] if n == index + 1)
                lp = plan.layers[index]
                assert got == Counter(lp.backward_ops), (key, index)
                forward = Counter((kind, el) for n, kind, el in entry["forward"] if n == index + 1)
                assert forward == Counter(lp.collective_ops), (key, index)
                assert lp.training_elements_per_token == sum(e for _, e in lp.collective_ops + lp.backward_ops)
            replicated_kv = layout == "deinfer" and TINY_CONFIGS[family].get("num_key_value_heads", 99) < tp
            assert (entry["weight_grad"] > 0) == replicated_kv, key


def test_deinfer_backward_is_two_reduce_scatters_and_two_all_reduces_of_h() -> None:
    """DESIGN.md §3 written out: per decomposed layer at TP=2, reduce-scatters of the padded
    Σr_qkv and Σr_gate|up, all-reduces of h for both block inputs; naive: one all-reduce of
    each factor pair's input width."""
    cfg = TINY_CONFIGS["llama"]
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    for rank, entry in _entries(2, 1)["llama/deinfer"]:
        r = entry["ranks"]
        base = "model.layers.0"
        qkv = sum(r[f"{base}.self_attn.{p}_proj"] for p in "qkv")
        mlp = r[f"{base}.mlp.gate_proj"] + r[f"{base}.mlp.up_proj"]
        pad = lambda n: -(-n // 2) * 2  # noqa: E731
        got = Counter((k, el) for n, k, el, _ in entry["backward"] if n == 1)
        assert got == Counter({("reduce_scatter", pad(qkv)): 1, ("reduce_scatter", pad(mlp)): 1,
                               ("all_reduce", h): 2})
    for rank, entry in _entries(2, 1)["llama/naive"]:
        got = Counter((k, el) for n, k, el, _ in entry["backward"] if n == 1)
        assert got == Counter({("all_reduce", h): 3, ("all_reduce", i): 1})  # qkv, o, gate|up in h; down in I


@pytest.mark.parametrize("family", FAMILIES)
def test_optimizer_steps_give_the_reference_losses_at_every_size(family: str) -> None:
    trajectories: dict[tuple[str, bool], list] = {}
    for tp, pp in SIZES:
        for key, ranks in _entries(tp, pp).items():
            fam, layout = key.split("/")
            if fam != family:
                continue
            want = reference(family, tp, layout)
            for rank, entry in ranks:
                got = entry["trajectory"]
                assert len(got) == STEPS
                for (loss, norm), (ref_loss, ref_norm) in zip(got, want):
                    assert loss == pytest.approx(ref_loss, rel=1e-6), (key, tp, pp)
                    assert norm == pytest.approx(ref_norm, rel=1e-5), (key, tp, pp)
                same_model = (layout, tp > TINY_CONFIGS[family].get("num_key_value_heads", 99))
                trajectories.setdefault(same_model, []).append(got)
    assert trajectories
    for runs in trajectories.values():  # one model, every size and rank: the same numbers
        for other in runs[1:]:
            for (a, na), (b, nb) in zip(runs[0], other):
                assert a == pytest.approx(b, rel=1e-9) and na == pytest.approx(nb, rel=1e-9)
    losses = [loss for loss, _ in next(iter(trajectories.values()))[0]]
    assert losses[-1] < losses[0], "three steps on one batch lower its loss"


def test_merged_v_padding_stays_zero_under_training() -> None:
    seen = 0
    for tp, pp in SIZES:
        for key, ranks in _entries(tp, pp).items():
            for rank, entry in ranks:
                assert all(v == 0.0 for v in entry["padding"]), (key, tp, pp)
                seen += len(entry["padding"])
    assert seen > 0, "some merged V has padding (Σr not a multiple of TP)"


def test_train_selects_u_v_or_every_block_matrix_and_refuses_an_empty_selection() -> None:
    for tp, pp in SIZES:
        for key, ranks in _entries(tp, pp).items():
            for rank, entry in ranks:
                selection = entry["selection"]
                if key.endswith("/dense"):  # the dense layout multiplies the factors out
                    assert selection.startswith("nothing to train: train='factors'"), selection
                    continue
                u, v = selection["u"], selection["v"]
                assert u and v, key  # every stage holds decomposed layers
                assert all(n.split(".")[-2] in ("linear_q_up", "linear_k_up", "linear_v_up", "up") for n in u), u
                assert all(n.split(".")[-2] in ("linear_qkv_down", "down") for n in v), v
                assert not set(u) & set(v)
                linear, everything = set(selection["linear"]), set(selection["all"])
                frozen = {n for n in everything if "norm" in n or "embedding" in n or "output_layer" in n}
                assert frozen and linear == everything - frozen, key  # every block matrix, nothing else
                assert set(u) | set(v) <= linear, key  # the factors (and any matrix kept dense)
