"""Weights that were not verified are never served.

A decomposed folder needs its manifest (or an explicit ``--no-verify``, which still checks
shapes and finite values); a corrupted, truncated or half-written folder is named in one line
by every command that reads it. In-process runs: nothing here starts more than one rank.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from deinfer_megatron.cli.main import run
from tests.robustness.test_inputs import cli_error

MANIFEST = "deinfer_manifest.json"


def _copy(models, tmp_path: Path, name: str = "model") -> Path:
    return Path(shutil.copytree(models.decomposed, tmp_path / name))


def _generate(model: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--layout", "deinfer", "--prompt", "It is a truth", "--max-new-tokens", "3",
            "--json", *extra]


def _tokens(capfd, argv: list[str]) -> list[int]:
    assert run(argv) == 0
    out, err = capfd.readouterr()
    return json.loads(out)["outputs"][0]["token_ids"]


def _set_float(path: Path, tensor: str, value: float) -> None:
    """Overwrite the first element of ``tensor`` (float32) inside a safetensors file."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start = json.loads(raw[8 : 8 + n])[tensor]["data_offsets"][0] + 8 + n
    raw[start : start + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("command", ["generate", "plan", "eval-ppl"])
def test_a_decomposed_folder_needs_its_manifest(models, tmp_path, capfd, command: str) -> None:
    model = _copy(models, tmp_path)
    (model / MANIFEST).unlink()
    text = tmp_path / "t.txt"
    text.write_text("Some words to read. " * 100)
    argv = {"generate": _generate(model), "plan": ["plan", "--model", str(model)],
            "eval-ppl": ["eval-ppl", "--model", str(model), "--text", str(text), "--window", "64"]}[command]
    line = cli_error(capfd, *argv)
    assert "has rank_config.json but no deinfer_manifest.json" in line and "--no-verify" in line


def test_a_manifest_must_vouch_for_every_file(models, tmp_path, capfd) -> None:
    model = _copy(models, tmp_path)
    manifest = json.loads((model / MANIFEST).read_text())
    (model / MANIFEST).write_text(json.dumps({**manifest, "files": {}}))
    assert "lists no files" in cli_error(capfd, *_generate(model))
    files = {k: v for k, v in manifest["files"].items() if k != "model.safetensors"}
    (model / MANIFEST).write_text(json.dumps({**manifest, "files": files}))
    assert "does not list model.safetensors" in cli_error(capfd, *_generate(model))
    (model / MANIFEST).write_text(json.dumps({**manifest, "files": {**manifest["files"], "config.json": "0" * 64}}))
    assert f"{model / 'config.json'} is corrupted (SHA-256 differs" in cli_error(capfd, "plan", "--model", str(model))


def test_corrupted_weights_are_caught_with_or_without_a_manifest(models, tmp_path, capfd) -> None:
    model = _copy(models, tmp_path)
    _set_float(model / "model.safetensors", "model.layers.1.mlp.down_proj.v", float("inf"))
    line = cli_error(capfd, *_generate(model))
    assert f"{model / 'model.safetensors'} is corrupted (SHA-256 differs" in line
    (model / MANIFEST).unlink()
    line = cli_error(capfd, *_generate(model, "--no-verify"))  # checked in the rank, when loaded
    assert "'model.layers.1.mlp.down_proj.v' holds NaN or infinite values" in line


def test_no_verify_serves_a_folder_made_elsewhere(models, tmp_path, capfd) -> None:
    expected = _tokens(capfd, _generate(models.decomposed))
    model = _copy(models, tmp_path)
    (model / MANIFEST).unlink()
    assert _tokens(capfd, _generate(model, "--no-verify")) == expected


def test_an_unfinished_folder_is_never_loaded(models, tmp_path, capfd) -> None:
    leftover = _copy(models, tmp_path, ".dec.tmp-somehost-12345-0a1b2c3d")  # a killed run's folder
    for argv in (_generate(leftover), ["plan", "--model", str(leftover)]):
        assert "is the temporary folder of a run that did not finish" in cli_error(capfd, *argv)
