"""Bad input to ``eval-choice``, each answered by one line on stderr and exit status 2 before
any rank starts (and before ``--layout auto``, its default, is priced). The command writes
nothing, so there is no output to leave half-written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deinfer_megatron.cli.main import run

GOOD = {"context": "It is a truth universally", "choices": ["acknowledged.", "forgotten."], "answer": 0}


def cli_error(capfd, *argv: object) -> str:
    code = run([str(a) for a in argv])
    out, err = capfd.readouterr()
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err[-3000:])
    assert out == "", "nothing on stdout for a refused command"
    return lines[0]


@pytest.fixture(autouse=True)
def no_pricing(monkeypatch) -> None:
    def never(*args, **kwargs):
        raise AssertionError("--layout auto was priced before the input was checked")

    monkeypatch.setattr("deinfer_megatron.planning.auto.auto_plan", never)


def _items(tmp_path: Path, *objects: object) -> Path:
    path = tmp_path / "items.jsonl"
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objects))
    return path


def test_bad_items_files_name_the_line(models, tmp_path, capfd) -> None:
    base = ["eval-choice", "--model", models.decomposed]
    path = _items(tmp_path, GOOD, "{\"context\": ")
    line = cli_error(capfd, *base, "--items", path)
    assert line.startswith(f"deinfer-megatron eval-choice: error: {path}:2: not JSON")
    path = _items(tmp_path, GOOD, GOOD, {**GOOD, "answer": 5})
    assert f'{path}:3: "answer" must be the index of a choice, 0..1, got 5' in cli_error(capfd, *base, "--items", path)
    path = _items(tmp_path, {**GOOD, "choice": ["a", "b"]})
    assert f"{path}:1: unknown key 'choice'" in cli_error(capfd, *base, "--items", path)
    assert "holds no items" in cli_error(capfd, *base, "--items", _items(tmp_path, ""))
    assert "does not exist" in cli_error(capfd, *base, "--items", tmp_path / "absent.jsonl")
    binary = tmp_path / "items.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert f"items file {binary} is a binary file" in cli_error(capfd, *base, "--items", binary)


def test_items_that_do_not_fit(models, tmp_path, capfd) -> None:
    base = ["eval-choice", "--model", models.decomposed]
    long = _items(tmp_path, GOOD, {**GOOD, "context": "word " * 5000})
    line = cli_error(capfd, *base, "--items", long)
    assert f"{long}:2: the context and choice " in line and "more than the model's context of 4096" in line
    short = _items(tmp_path, GOOD)
    line = cli_error(capfd, *base, "--items", short, "--batch-tokens", "3")
    assert f"{short}:1: the context and choice" in line and "more than --batch-tokens 3; use --batch-tokens" in line
    line = cli_error(capfd, *base, "--items", short, "--batch-tokens", "0")
    assert "--batch-tokens must be at least 1, got 0" in line


def test_options_and_sizes(models, tmp_path, capfd) -> None:
    items = _items(tmp_path, GOOD)
    base = ["eval-choice", "--model", models.decomposed, "--items", items]
    assert "--per-item applies to --json; add --json" in cli_error(capfd, *base, "--per-item")
    assert "valid TP sizes: 1, 2, 4, 8" in cli_error(capfd, *base, "--tp", "3")
    assert "4 layers do not split evenly over --pp 3" in cli_error(capfd, *base, "--pp", "3")
    huge = tmp_path / "huge"
    shutil.copytree(models.decomposed, huge)
    cfg = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**cfg, "hidden_size": 10**9}))
    line = cli_error(capfd, "eval-choice", "--model", huge, "--items", items, "--no-verify")
    assert "GiB is available" in line and "lower --batch-tokens" in line
