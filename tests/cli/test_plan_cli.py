"""``deinfer-megatron plan`` as a user runs it: a model folder in, a table or JSON out."""

from __future__ import annotations

import json

import pytest

from deinfer_megatron.checkpoints.folder import FORMAT, MANIFEST
from deinfer_megatron.cli.main import run
from deinfer_megatron.files.checksums import sha256
from tests.helpers.cli import run_cli_together
from tests.helpers.tiny_models import TINY_CONFIGS


@pytest.fixture()
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIGS["llama"]))
    ranks = {f"model.layers.0.self_attn.{p}": 8 for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    (tmp_path / "rank_config.json").write_text(json.dumps(ranks))
    files = {name: sha256(tmp_path / name) for name in ("config.json", "rank_config.json")}
    (tmp_path / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": files}))
    return tmp_path


def test_json_for_one_layout_uses_the_folder_rank_config(model_dir, capsys) -> None:
    assert run(["plan", "--model", str(model_dir), "--tp", "2", "--layout", "deinfer", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"] == "deinfer" and doc["tp"] == 2
    first, second = doc["layers"][0], doc["layers"][1]
    assert set(first) >= {"index", "kind", "collectives", "elements_per_token", "params_per_rank",
                          "kv_bytes_per_token"}
    assert first["kind"] == "attention-decomposed" and first["collectives"] == 3
    assert first["elements_per_token"] == 24 + 8 + 64  # AG(q+k+v) + AR(r_o) + dense MLP AR(h)
    assert second["kind"] == "dense" and second["elements_per_token"] == 128
    assert doc["totals"]["collectives_per_token"] == 3 + 3 * 2


def test_table_shows_all_layouts(model_dir, capsys) -> None:
    assert run(["plan", "--model", str(model_dir), "--tp", "2", "--batch", "8", "--seq", "128"]) == 0
    out = capsys.readouterr().out
    for layout in ("dense", "naive", "deinfer"):
        assert f"{layout}: " in out
    assert "per forward of 8x128 tokens" in out


def test_bad_inputs_are_one_line_errors(model_dir, tmp_path) -> None:
    cases = [
        (["plan", "--model", str(tmp_path / "nope")], "no config.json"),
        (["plan", "--model", str(model_dir), "--tp", "3"], "valid TP sizes: 1, 2, 4, 8"),
        (["plan", "--model", str(model_dir), "--pp", "5"], "--pp 5 must be between 1 and"),
        (["plan", "--model", str(model_dir), "--rank-config", str(tmp_path / "x.json")], "does not exist"),
    ]
    for (_, message), proc in zip(cases, run_cli_together([(argv, {}) for argv, _ in cases])):
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], proc.stderr


def test_auto_shows_the_choice_per_block_and_the_predicted_step(model_dir, tmp_path, capsys) -> None:
    """Layer 0's attention is decomposed at rank 8: a params-only table makes naive the cheapest
    there (8·(64+64)·2 + 8·(64+32)·2 = 3584 parameters against dense 64·128 + 64·64 = 12288,
    both split over the TP=2 ranks); every other block is dense in the model."""
    from tests.helpers.cost_tables import params_only

    table = tmp_path / "table.json"
    table.write_text(json.dumps(params_only().to_json()))
    args = ["plan", "--model", str(model_dir), "--tp", "2", "--layout", "auto", "--cost-table", str(table),
            "--batch", "8", "--seq", "64"]
    assert run([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"] == "auto"
    assert [l["layouts"] for l in doc["layers"]] == [{"attention": "naive", "mlp": "dense"}] + [
        {"attention": "dense", "mlp": "dense"}] * 3
    predicted = doc["totals"]["predicted_decode_step_s"]
    assert set(predicted) == {"auto", "deinfer", "naive", "dense"}
    # params-only: 2 · batch · params per rank / rate, the rate of the injected table (1e9 flop/s),
    # for the 4 layers and the output layer (its 102 padded vocabulary rows split over the ranks)
    dense_layer = (64 * 128 + 64 * 64 + 3 * 64 * 96) // 2
    output_layer = 102 // 2 * 64
    assert predicted["dense"] == pytest.approx(2 * 8 * (4 * dense_layer + output_layer) / 1e9)
    assert predicted["auto"] == pytest.approx(predicted["naive"])
    assert predicted["naive"] < predicted["dense"]
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "naive/dense" in out and "dense/dense" in out and "predicted decode step" in out


def test_cost_table_needs_auto(model_dir, tmp_path, capsys) -> None:
    assert run(["plan", "--model", str(model_dir), "--layout", "naive", "--cost-table", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cost-table is read by --layout auto only" in err[0]
    assert run(["plan", "--model", str(model_dir), "--layout", "auto", "--cost-table", str(tmp_path / "t.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
