"""``deinfer-megatron serve`` / ``loadgen``: bad input is one line on stderr and exit status 2,
before any rank starts. (The running server is tested in tests/serving.)"""

from __future__ import annotations

import contextlib
import io
import socket

import pytest

from deinfer_megatron.cli.main import build_parser, run
from deinfer_megatron.launch.local import free_port
from deinfer_megatron.serving.blocks import DEFAULT_BLOCK_SIZE
from deinfer_megatron.serving.scheduler import DEFAULT_PREFILL_CHUNK
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
    assert "--kv-cache latent needs a decomposed model" in one_line_error(
        "serve", "--model", str(dense), "--kv-cache", "latent")
    assert "--kv-cache latent needs --layout deinfer" in one_line_error(
        "serve", "--model", str(dec), "--layout", "dense", "--kv-cache", "latent")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit, match="2"):  # argparse's own refusal
        run(["serve", "--model", str(dec), "--layout", "auto"])
    assert "argument --layout: serve takes a fixed layout (dense, naive, deinfer), not auto" in err.getvalue()
    assert len([line for line in err.getvalue().splitlines() if "error" in line]) == 1, "the usage, then one line"
    assert "--max-batch must be at least 1" in one_line_error("serve", "--model", str(dec), "--max-batch", "0")
    assert "--kv-cache latent needs --layout deinfer" in one_line_error(
        "serve", "--model", str(dec), "--layout", "naive", "--kv-cache", "latent")
    assert "--max-seq-len must be between 1 and the model's context of 128" in one_line_error(
        "serve", "--model", str(dec), "--max-seq-len", "4096")
    assert "--port must be between" in one_line_error("serve", "--model", str(dec), "--port", "70000")
    assert "--kv-budget-gb must be" in one_line_error("serve", "--model", str(dec), "--kv-budget-gb", "-1")


def test_the_pool_flags_reach_the_job() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "m"])
    job = args.make_config(args).job
    assert (job.block_size, job.prefix_caching, job.prefill_chunk) == (DEFAULT_BLOCK_SIZE, True, DEFAULT_PREFILL_CHUNK)
    args = parser.parse_args(["serve", "--model", "m", "--block-size", "8", "--no-prefix-cache", "--prefill-chunk", "32"])
    job = args.make_config(args).job
    assert (job.block_size, job.prefix_caching, job.prefill_chunk) == (8, False, 32)


def test_the_port_is_held_before_the_ranks_join_and_a_busy_one_is_one_line(folders, monkeypatch) -> None:
    """The HTTP port is bound before gloo opens its sockets (which could take it while the model
    loads), released when the job ends, and a port in use is one line before any rank joins."""
    from deinfer_megatron.runtime import job

    _, dec = folders
    port, seen = free_port(), {}

    def joined(*args, **kwargs):
        with socket.socket() as probe:
            seen["listening"] = probe.connect_ex(("127.0.0.1", port)) == 0
        raise RuntimeError("the ranks would join here")

    monkeypatch.setattr(job, "init_parallel", joined)  # where the runtime joins the groups
    assert "the ranks would join here" in one_line_error("serve", "--model", str(dec), "--port", str(port))
    assert seen == {"listening": True}
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not refused over the probe's TIME_WAIT
        busy.bind(("127.0.0.1", port))  # released by the job that failed
        busy.listen()
        line = one_line_error("serve", "--model", str(dec), "--port", str(port))
    assert f"could not serve on 127.0.0.1:{port} (Address already in use); choose another --port" in line
    assert seen == {"listening": True}, "a busy port fails before the ranks join"


def test_bad_loadgen_input_is_one_line() -> None:
    assert "give --url" in one_line_error("loadgen")
    assert "--url needs --served-model-name" in one_line_error("loadgen", "--url", "http://127.0.0.1:9/v1")
    assert "--rate must be > 0" in one_line_error("loadgen", "--url", "http://x/v1", "--served-model-name", "m",
                                                  "--rate", "0")
    assert "no request was answered by http://127.0.0.1:9/v1" in one_line_error(
        "loadgen", "--url", "http://127.0.0.1:9/v1", "--served-model-name", "m", "--requests", "2", "--rate", "100")
