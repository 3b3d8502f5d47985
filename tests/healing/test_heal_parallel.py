"""``heal --tp/--pp``: the Megatron student healed on 2 ranks ends with the weights of the
one-rank run (same seed, same data order), a kill at TP=2 followed by ``--resume`` ends with
the uninterrupted TP=2 weights bit for bit, the parallel run lowers the KL measured by
transformers alone (``test_heal.py``'s reference), and ``--train linear`` moves every matrix of
the blocks — factors and matrices kept dense — alike on one and two ranks, nothing else."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deinfer_megatron.checkpoints.folder import MANIFEST
from deinfer_megatron.files.failpoints import ENV
from deinfer_megatron.healing.job import HealJob, run_heal
from deinfer_megatron.healing.state import state_dir
from tests.healing.test_heal import _reference_kl
from tests.robustness.harness import run_cli

STEPS, BATCH, SEQ = 24, 2, 32
SAME = 1e-5  # relative (Frobenius) difference of every healed tensor between TP/PP sizes
SAME_ADAM = 1e-4  # the same after few steps (Adam's first updates are ±lr whatever a gradient's size)


@lru_cache(maxsize=None)
def _healed(pair, root: Path, tp: int, pp: int) -> Path:
    out = root / f"tp{tp}pp{pp}"
    run_heal(HealJob(model=pair.dec, teacher=pair.dense, out=out, calib_text=(pair.heal_text,),
                     tokens=STEPS * BATCH * SEQ, batch=BATCH, seq_len=SEQ, lr=3e-3, warmup=2, tp=tp, pp=pp))
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("heal-parallel")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=str)
def test_parallel_heal_gives_the_one_rank_weights(pair, root, tp, pp) -> None:
    one, many = _tensors(_healed(pair, root, 1, 1)), _tensors(_healed(pair, root, tp, pp))
    original = _tensors(pair.dec)
    assert one.keys() == many.keys() == original.keys()
    moved = [k for k in one if not one[k].equal(original[k])]
    assert moved and all(k.endswith((".u", ".v")) for k in moved), moved[:5]  # the factors train, the rest not
    for k in one:
        rel = ((many[k] - one[k]).norm() / one[k].norm()).item()
        assert rel <= SAME, (k, rel)
    healing = json.loads((_healed(pair, root, tp, pp) / MANIFEST).read_text())["healing"]
    assert (healing["tp"], healing["pp"], healing["layout"], healing["steps"]) == (tp, pp, "deinfer", STEPS)


def test_parallel_heal_lowers_the_kl_measured_by_transformers(pair, root) -> None:
    out = _healed(pair, root, 2, 1)
    before, after = _reference_kl(pair.dense, pair.dec, pair.held_out), _reference_kl(pair.dense, out, pair.held_out)
    assert after < 0.8 * before, (before, after)


def _args(pair, out: Path, *extra: str) -> list[str]:
    return ["heal", "--model", str(pair.dec), "--teacher", str(pair.dense), "--calib-text", str(pair.heal_text),
            "--tokens", str(STEPS * BATCH * SEQ), "--batch", str(BATCH), "--seq-len", str(SEQ), "--lr", "3e-3",
            "--warmup", "2", "--tp", "2", "--save-every", str(STEPS // 2), "--out", str(out), *extra]


def test_resume_after_a_kill_at_tp2_ends_with_the_uninterrupted_weights(pair, root, tmp_path) -> None:
    out, log = tmp_path / "resumed", tmp_path / "log.jsonl"
    killed = run_cli(*_args(pair, out, "--json", str(log)), tmp=tmp_path, env={ENV: "heal.after-checkpoint"})
    assert killed.code != 0 and not killed.survivors, killed.stderr[-2000:]
    assert not out.exists() and (state_dir(out) / "checkpoint" / "meta.pt").is_file()
    resumed = run_cli(*_args(pair, out, "--json", str(log), "--resume"), tmp=tmp_path)
    assert resumed.code == 0, resumed.stderr[-2000:]
    whole, got = _tensors(_healed(pair, root, 2, 1)), _tensors(out)
    assert whole.keys() == got.keys()
    assert all(whole[k].equal(got[k]) for k in whole), [k for k in whole if not whole[k].equal(got[k])][:5]
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(1, STEPS + 1))
    assert not state_dir(out).exists()


def test_dense_layout_and_block_distillation_at_tp2_are_refused(pair, tmp_path) -> None:
    base = dict(model=pair.dec, teacher=pair.dense, out=tmp_path / "out", calib_text=(pair.heal_text,), tokens=64)
    with pytest.raises(ValueError, match="--layout 'dense' cannot heal"):
        run_heal(HealJob(**base, layout="dense"))
    with pytest.raises(ValueError, match="--distill blocks runs in one process only"):
        run_heal(HealJob(**base, distill="blocks", tp=2))
    with pytest.raises(ValueError, match="--tp 3 does not split"):
        run_heal(HealJob(**base, tp=3))
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def half_dense(pair, tmp_path_factory) -> Path:
    """The pair's teacher with only its first layer decomposed: the second keeps dense matrices."""
    from deinfer_megatron.decompose.job import DecomposeJob, run_decompose

    root = tmp_path_factory.mktemp("half-dense")
    ranks = {n: r for n, r in json.loads((pair.dec.parent / "ranks.json").read_text()).items()
             if n.startswith("model.layers.0.")}
    (root / "ranks.json").write_text(json.dumps(ranks))
    return run_decompose(DecomposeJob(pair.dense, "svd", rank_config=root / "ranks.json", out=root / "dec"))


def test_train_linear_moves_every_block_matrix_alike_on_one_and_two_ranks(pair, half_dense, tmp_path) -> None:
    healed = {}
    for tp in (1, 2):
        run_heal(HealJob(model=half_dense, teacher=pair.dense, out=tmp_path / f"tp{tp}", calib_text=(pair.heal_text,),
                         tokens=16 * BATCH * SEQ, batch=BATCH, seq_len=SEQ, lr=1e-3, warmup=2, tp=tp, train="linear"))
        healed[tp] = _tensors(tmp_path / f"tp{tp}")
    original = _tensors(half_dense)
    moved = {k for k in original if not healed[1][k].equal(original[k])}
    blocks = {k for k in original if k.startswith("model.layers.") and "norm" not in k}
    assert any(k.endswith(".u") for k in blocks) and any(k.startswith("model.layers.1.") for k in blocks)
    assert moved == blocks  # factors and kept-dense matrices; embeddings and norms stay
    rel = {k: ((healed[2][k] - healed[1][k]).norm() / healed[1][k].norm()).item() for k in original}
    assert max(rel.values()) <= SAME_ADAM, sorted(rel.items(), key=lambda kv: -kv[1])[:3]
    assert json.loads((tmp_path / "tp2" / MANIFEST).read_text())["healing"]["train"] == "linear"
    assert _reference_kl(pair.dense, tmp_path / "tp1", pair.held_out) < _reference_kl(pair.dense, half_dense,
                                                                                     pair.held_out)
