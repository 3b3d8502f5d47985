"""``deinfer-megatron convert`` as users run it: a decomposed (and a dense) tiny LLaMA folder
to a Megatron torch_dist checkpoint and back, with the same bytes in every tensor; the
checkpoint served by ``generate`` and read by ``plan`` as it is, giving the greedy tokens of a
Hugging Face model whose factors are multiplied out; one-line errors, nothing written, for bad
input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.checkpoints.folder import write_decomposed
from deinfer_megatron.cli.main import run
from deinfer_megatron.specs.rank_config import RankConfig
from tests.helpers.tiny_models import decompose_randomly, mixed_ranks, save_tiny_folder

PROMPT = "It is a truth universally acknowledged"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("convert")
    hf = save_tiny_folder("llama", root / "dense")
    ranks = mixed_ranks(hf, [0, 2, 3])
    state = decompose_randomly(hf, ranks)  # hf now holds U·V: the reference
    arch = arch_from_hf_config(hf.config.to_dict())
    write_decomposed(root / "dec", config=json.loads((root / "dense" / "config.json").read_text()),
                     tensors=state, rank_config=RankConfig.from_mapping(ranks, arch),
                     tokenizer_dir=root / "dense", metadata={"method": "random"})
    ckpt = root / "ckpt"
    # written by one rank in this process (tests/checkpoints/test_dist_checkpoint.py saves with
    # two, and loads at other sizes); served below at TP=1 under another layout
    assert run(["convert", "--model", str(root / "dec"), "--to", "megatron", "--pp", "1", "--out", str(ckpt)]) == 0
    return {"root": root, "hf": hf, "dense": root / "dense", "dec": root / "dec", "ckpt": ckpt}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _assert_same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].contiguous().view(torch.uint8).equal(b[k].contiguous().view(torch.uint8)), k


def test_decomposed_round_trip_is_lossless(folders) -> None:
    ckpt = folders["ckpt"]
    manifest = json.loads((ckpt / "deinfer_manifest.json").read_text())
    assert manifest["saved_with"] == {"tp": 1, "pp": 1, "layout": "deinfer"}
    assert any(name.startswith("release/") and name.endswith(".distcp") for name in manifest["files"])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "release"
    back = folders["root"] / "back"
    assert run(["convert", "--model", str(ckpt), "--to", "hf", "--out", str(back)]) == 0
    _assert_same_bytes(_tensors(back), _tensors(folders["dec"]))
    for name in ("config.json", "rank_config.json", "tokenizer.json"):
        assert (back / name).read_bytes() == (folders["dec"] / name).read_bytes(), name


def test_dense_round_trip_is_lossless(folders, capsys) -> None:
    root = folders["root"]
    assert run(["convert", "--model", str(folders["dense"]), "--to", "megatron", "--out", str(root / "dense-ckpt")]) == 0
    assert run(["convert", "--model", str(root / "dense-ckpt"), "--to", "hf", "--out", str(root / "dense-back")]) == 0
    _assert_same_bytes(_tensors(root / "dense-back"), _tensors(folders["dense"]))
    tokens = []
    for model in (root / "dense-ckpt", folders["dense"]):  # Megatron's loader on a dense checkpoint
        capsys.readouterr()
        assert run(["generate", "--model", str(model), "--prompt", PROMPT, "--max-new-tokens", "4", "--json"]) == 0
        tokens.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"][0]["token_ids"])
    assert tokens[0] == tokens[1]
    for model, out in ((root / "dense-ckpt", "dec-from-ckpt"), (folders["dense"], "dec-from-folder")):
        # decompose reads the checkpoint (and its tokenizer, copied beside it) as the folder
        assert run(["decompose", "--model", str(model), "--method", "svd", "--ratio", "0.9", "--layers", "0",
                    "--out", str(root / out)]) == 0
    _assert_same_bytes(_tensors(root / "dec-from-ckpt"), _tensors(root / "dec-from-folder"))


def test_the_checkpoint_is_served_and_planned_as_it_is(folders, capsys) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folders["dense"])
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        want = folders["hf"].generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    capsys.readouterr()
    assert run(["generate", "--model", str(folders["ckpt"]), "--prompt", PROMPT, "--max-new-tokens", "5",
                "--layout", "naive", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["outputs"][0]["token_ids"] == want[0, ids.shape[1]:].tolist()
    tokens = {}
    for model in ("ckpt", "dec"):  # bfloat16 from the float32 checkpoint: cast as a folder's load casts
        assert run(["generate", "--model", str(folders[model]), "--prompt", PROMPT, "--max-new-tokens", "5",
                    "--layout", "deinfer", "--dtype", "bfloat16", "--json"]) == 0
        tokens[model] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"][0]["token_ids"]
    assert tokens["ckpt"] == tokens["dec"]
    assert run(["plan", "--model", str(folders["ckpt"]), "--tp", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert run(["plan", "--model", str(folders["dec"]), "--tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == plan and plan[0]["layers"][0]["kind"] == "decomposed"


def _fails(capsys, argv: list[str], message: str) -> None:
    capsys.readouterr()
    assert run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_bad_input_is_one_line_and_writes_nothing(folders, tmp_path, capsys) -> None:
    dec, ckpt = str(folders["dec"]), str(folders["ckpt"])
    out = tmp_path / "out"
    _fails(capsys, ["convert", "--model", ckpt, "--to", "hf", "--tp", "2", "--out", str(out)], "do not apply to --to hf")
    _fails(capsys, ["convert", "--model", ckpt, "--to", "megatron", "--out", str(out)], "is a Megatron checkpoint already")
    _fails(capsys, ["convert", "--model", dec, "--to", "hf", "--out", str(out)], "is not a Megatron checkpoint")
    _fails(capsys, ["convert", "--model", dec, "--to", "megatron", "--tp", "3", "--out", str(out)], "--tp 3 does not split")
    assert not out.exists() and not list(tmp_path.iterdir())
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    _fails(capsys, ["convert", "--model", dec, "--to", "megatron", "--out", str(out)], "exists and is not empty")
    _fails(capsys, ["convert", "--model", ckpt, "--to", "hf", "--out", str(out), "--overwrite"],
           "is not a model folder made by deinfer-megatron")
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    bad = tmp_path / "corrupted"
    shutil.copytree(ckpt, bad)
    shard = next((bad / "release").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _fails(capsys, ["convert", "--model", str(bad), "--to", "hf", "--out", str(tmp_path / "x")], "is corrupted")
    _fails(capsys, ["generate", "--model", str(bad), "--prompt", "x", "--max-new-tokens", "1"], "is corrupted")
    assert not (tmp_path / "x").exists()


def test_opt_is_refused(tmp_path, capsys) -> None:
    save_tiny_folder("opt", tmp_path / "opt")
    _fails(capsys, ["convert", "--model", str(tmp_path / "opt"), "--to", "megatron", "--out", str(tmp_path / "o")],
           "cannot be converted losslessly")
