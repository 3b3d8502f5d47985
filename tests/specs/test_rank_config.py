"""Rank config validation against the model config, and its JSON file format."""

from __future__ import annotations

import json

import pytest

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.specs.rank_config import MlpRanks, RankConfig
from tests.helpers.tiny_models import TINY_CONFIGS

LLAMA = arch_from_hf_config(TINY_CONFIGS["llama"])
OPT = arch_from_hf_config(TINY_CONFIGS["opt"])
ATTN = {f"model.layers.1.self_attn.{p}": r for p, r in
        (("q_proj", 20), ("k_proj", 7), ("v_proj", 9), ("o_proj", 30))}
MLP = {f"model.layers.1.mlp.{p}": r for p, r in (("gate_proj", 11), ("up_proj", 13), ("down_proj", 17))}


def test_valid_config_normalises_per_layer_ranks() -> None:
    rc = RankConfig.from_mapping({**ATTN, **MLP}, LLAMA)
    layer = rc.layers[1]
    assert (layer.attention.q, layer.attention.k, layer.attention.v, layer.attention.o) == (20, 7, 9, 30)
    assert layer.mlp == MlpRanks((11, 13), 17)
    assert not rc.layers[0].decomposed and rc.layers[1].decomposed


def test_attention_and_mlp_may_be_decomposed_independently() -> None:
    rc = RankConfig.from_mapping(MLP, LLAMA)
    assert rc.layers[1].attention is None and rc.layers[1].mlp is not None


def test_opt_names() -> None:
    rc = RankConfig.from_mapping({"model.decoder.layers.0.fc1": 8, "model.decoder.layers.0.fc2": 9}, OPT)
    assert rc.layers[0].mlp == MlpRanks((8,), 9)


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({"model.layers.9.self_attn.q_proj": 4}, r"unknown module 'model\.layers\.9"),
        ({"model.layers.1.mlp.gate": 4}, r"unknown module"),
        ({**ATTN, "model.layers.1.self_attn.q_proj": 0}, r"rank 0 .* must be in 1\.\.64"),
        ({**ATTN, "model.layers.1.self_attn.k_proj": 33}, r"must be in 1\.\.32 \(the matrix is 32x64\)"),
        ({**ATTN, "model.layers.1.self_attn.k_proj": 3.5}, r"must be an integer"),
        ({"model.layers.1.self_attn.q_proj": 8}, r"layer 1 attention is partly decomposed.*missing"),
        ({"model.layers.1.mlp.down_proj": 8}, r"layer 1 MLP is partly decomposed"),
    ],
)
def test_bad_configs_name_the_problem(mapping: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RankConfig.from_mapping(mapping, LLAMA)


def test_file_round_trip_and_bad_json(tmp_path) -> None:
    rc = RankConfig.from_mapping({**ATTN, **MLP}, LLAMA)
    path = tmp_path / "rank_config.json"
    rc.save(path)
    assert json.loads(path.read_text()) == {**ATTN, **MLP}
    assert RankConfig.load(path, LLAMA) == rc
    assert list(tmp_path.iterdir()) == [path], "no temp file left behind"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        RankConfig.load(path, LLAMA)
    with pytest.raises(FileNotFoundError):
        RankConfig.load(tmp_path / "missing.json", LLAMA)


def test_unsupported_architecture_lists_supported() -> None:
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*llama.*qwen2.*opt"):
        arch_from_hf_config({"model_type": "gpt2"})
