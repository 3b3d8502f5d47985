"""``deinfer-megatron serve`` / ``loadgen``: bad input is one line on stderr and exit status 2,
before any rank starts. (The running server is tested in tests/serving.)"""

from __future__ import annotations

import contextlib
import io

import pytest

from deinfer_megatron.cli.main import run
from tests.helpers.tiny_models import full_rank_folders


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    _, dense, dec = full_rank_folders(tmp_path_factory.mktemp("serve-cli"), "llama")
    return dense, dec


def one_line_error(*argv: str) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run(list(argv))
    lines = [line for line in err.getvalue().splitlines() if "error" in line]
    assert code == 2 and len(lines) == 1, err.getvalue()
    return lines[0]


def test_bad_serve_input_is_one_line(folders) -> None:
    dense, dec = folders
    assert "serve needs a decomposed model" in one_line_error("serve", "--model", str(dense))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit, match="2"):  # argparse's own refusal
        run(["serve", "--model", str(dec), "--layout", "dense"])
    assert "argument --layout: serve runs the factored layouts (naive, deinfer), not dense" in err.getvalue()
    assert len([line for line in err.getvalue().splitlines() if "error" in line]) == 1, "the usage, then one line"
    assert "--max-batch must be at least 1" in one_line_error("serve", "--model", str(dec), "--max-batch", "0")
    assert "--kv-cache latent needs --layout deinfer" in one_line_error(
        "serve", "--model", str(dec), "--layout", "naive", "--kv-cache", "latent")
    assert "--max-seq-len must be between 1 and the model's context of 128" in one_line_error(
        "serve", "--model", str(dec), "--max-seq-len", "4096")
    assert "--port must be between" in one_line_error("serve", "--model", str(dec), "--port", "70000")
    assert "--kv-budget-gb must be" in one_line_error("serve", "--model", str(dec), "--kv-budget-gb", "-1")


def test_bad_loadgen_input_is_one_line() -> None:
    assert "give --url" in one_line_error("loadgen")
    assert "--url needs --served-model-name" in one_line_error("loadgen", "--url", "http://127.0.0.1:9/v1")
    assert "--rate must be > 0" in one_line_error("loadgen", "--url", "http://x/v1", "--served-model-name", "m",
                                                  "--rate", "0")
    assert "no request was answered by http://127.0.0.1:9/v1" in one_line_error(
        "loadgen", "--url", "http://127.0.0.1:9/v1", "--served-model-name", "m", "--requests", "2", "--rate", "100")
