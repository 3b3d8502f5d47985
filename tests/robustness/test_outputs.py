"""``decompose`` and ``fetch-model`` never destroy what they did not make.

Each case runs the real command and compares a snapshot of every folder involved before and
after: a refused ``--out`` is left exactly as it was, and so is the input model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.robustness.harness import assert_one_line_error, assert_unchanged, run_cli, snapshot

DECOMPOSE = ("decompose", "--method", "svd", "--ratio", "0.5")


def _user_folder(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "sub" / "thesis.tex").write_text("years of work")
    return path


def test_decompose_never_replaces_a_users_folder(models, tmp_path: Path) -> None:
    home = _user_folder(tmp_path / "home")
    before = snapshot(home, models.dense)
    refused = run_cli(*DECOMPOSE, "--model", str(models.dense), "--out", str(home), tmp=tmp_path)
    assert_one_line_error(refused, f"--out {home} exists and is not empty", "--overwrite")
    forced = run_cli(*DECOMPOSE, "--model", str(models.dense), "--out", str(home), "--overwrite", tmp=tmp_path)
    assert_one_line_error(forced, "is not a model folder made by deinfer-megatron")
    assert_unchanged(before, snapshot(home, models.dense))


def test_decompose_never_writes_over_its_input(models, tmp_path: Path) -> None:
    work = tmp_path / "work"
    shutil.copytree(models.dense, work / "model")
    before = snapshot(work)
    for out in (work / "model", work):  # the input itself, and a folder holding it
        result = run_cli(*DECOMPOSE, "--model", str(work / "model"), "--out", str(out), "--overwrite", tmp=tmp_path)
        assert_one_line_error(result, "is (or contains) the input")
    assert_unchanged(before, snapshot(work))


def test_overwrite_replaces_only_a_folder_it_made(models, tmp_path: Path) -> None:
    out = tmp_path / "dec"
    first = run_cli(*DECOMPOSE, "--model", str(models.dense), "--out", str(out), tmp=tmp_path)
    assert first.code == 0 and not first.survivors, first.stderr[-2000:]
    old_manifest = (out / "deinfer_manifest.json").read_text()
    before = snapshot(models.dense)
    again = run_cli("decompose", "--method", "svd", "--ratio", "0.7", "--model", str(models.dense),
                    "--out", str(out), "--overwrite", tmp=tmp_path)
    assert again.code == 0 and not again.survivors, again.stderr[-2000:]
    assert (out / "deinfer_manifest.json").read_text() != old_manifest  # replaced, at ratio 0.7
    assert '"ratio": 0.7' in (out / "deinfer_manifest.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert_unchanged(before, snapshot(models.dense))


def test_fetch_model_never_replaces_a_users_folder_or_file(tmp_path: Path) -> None:
    home = _user_folder(tmp_path / "home")
    a_file = tmp_path / "model.bin"
    a_file.write_bytes(b"\x00" * 10)
    before = snapshot(home, a_file)
    for extra, message in (([], "exists and is not empty"), (["--overwrite"], "is not a model folder made by")):
        result = run_cli("fetch-model", "smollm2-135m", "--out", str(home), *extra, tmp=tmp_path)
        assert_one_line_error(result, message)
    result = run_cli("fetch-model", "smollm2-135m", "--out", str(a_file), tmp=tmp_path)
    assert_one_line_error(result, "exists and is not a folder")
    assert_unchanged(before, snapshot(home, a_file))
