"""Killed processes, interrupted commands and crashes mid-write: the job always ends whole.

Real processes throughout: a rank killed with ``kill -9``, the command itself killed (with its
own ranks, and under torchrun), Ctrl-C, ``decompose`` killed at named points of its write
(``files.failpoints``) followed by a rerun, two jobs at once, and a checkpoint carrying a
malicious pickle. After each, no process of the job may remain and its private TMPDIR must be
empty (``harness.Job``).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch

from deinfer_megatron.checkpoints.folder import open_model
from tests.robustness.harness import Job, assert_one_line_error, listening_addresses, run_cli, snapshot
from tests.robustness.test_inputs import cli_error

LONG = ("generate", "--tp", "2", "--own-loop", "--max-new-tokens", "3000", "--prompt", "Once upon a time")
LOOPBACK = ("127.0.0.1:", "::1:")


def _running(models, tmp_path: Path, *extra: str) -> tuple[Job, list[int]]:
    job = Job(*LONG, "--model", str(models.dense), *extra, tmp=tmp_path)
    ranks = job.wait_for(2)
    time.sleep(8)  # loaded and generating
    assert job.proc.poll() is None, "generation should still be running"
    return job, ranks


def test_a_killed_rank_ends_the_job_and_ranks_listen_on_loopback_only(models, tmp_path) -> None:
    job, ranks = _running(models, tmp_path)
    for pid in [job.proc.pid, *job.processes()]:
        for addr in listening_addresses(pid):
            assert addr.startswith(LOOPBACK), f"process {pid} listens on {addr}"
    killed_at = time.monotonic()
    os.kill(max(ranks), signal.SIGKILL)
    result = job.finish(timeout=60)
    assert time.monotonic() - killed_at < 30
    line = assert_one_line_error(result, "died", code=2)
    assert "rank" in line and "exit code -9" in line


def test_killing_the_command_ends_its_ranks(models, tmp_path) -> None:
    job, _ = _running(models, tmp_path)
    os.kill(job.proc.pid, signal.SIGKILL)
    result = job.finish(timeout=30, grace=10)
    assert result.code == -signal.SIGKILL and not result.survivors, result.stderr[-2000:]


def test_ctrl_c_is_one_line_and_stops_every_rank(models, tmp_path) -> None:
    job, _ = _running(models, tmp_path)
    state = job.signal_state()
    os.killpg(job.proc.pid, signal.SIGINT)  # what a terminal sends: the whole foreground group
    result = job.finish(timeout=30)
    assert result.code == 130, f"exit {result.code} after SIGINT; the command had {state}"
    assert_one_line_error(result, "interrupted", code=130)


def test_killing_the_command_under_torchrun_ends_everything(models, tmp_path) -> None:
    job = Job(*LONG, "--model", str(models.dense), "--launcher", "torchrun", tmp=tmp_path)
    job.wait_for(3, timeout=180)  # torchrun and its two ranks besides the command
    time.sleep(5)
    os.kill(job.proc.pid, signal.SIGKILL)
    result = job.finish(timeout=30, grace=15)
    assert not result.survivors, result.stderr[-2000:]


def test_two_jobs_at_once(models, tmp_path) -> None:
    args = ("generate", "--model", str(models.decomposed), "--tp", "2", "--layout", "deinfer", "--max-new-tokens", "4", "--json",
            "--prompt", "It is a truth universally acknowledged")
    jobs = [Job(*args, tmp=tmp_path) for _ in range(2)]
    results = [j.finish(timeout=300) for j in jobs]
    for r in results:
        assert r.code == 0 and not r.survivors, r.stderr[-2000:]
    outputs = [json.loads(r.stdout)["outputs"] for r in results]  # stdout is the document alone
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("point", ["decompose.after-weights", "staging.before-publish"])
def test_decompose_killed_mid_write_leaves_no_model_and_a_rerun_succeeds(models, tmp_path, capfd, point) -> None:
    out = tmp_path / "dec"
    args = ("decompose", "--model", str(models.dense), "--method", "svd", "--ratio", "0.5", "--out", str(out))
    killed = run_cli(*args, tmp=tmp_path, env={"DEINFER_MEGATRON_KILL_AT": point})
    assert killed.code == -signal.SIGKILL and not killed.survivors
    assert not out.exists()
    (leftover,) = [p for p in tmp_path.iterdir() if p.name.startswith(".dec.tmp-")]
    assert "temporary folder of a run that did not finish" in cli_error(capfd, "plan", "--model", leftover)
    rerun = run_cli(*args, tmp=tmp_path)
    assert rerun.code == 0 and not rerun.survivors, rerun.stderr[-2000:]
    assert not leftover.exists(), "the rerun removes what the killed run left"
    assert open_model(out).decomposed


def test_decompose_killed_after_replacing_keeps_a_whole_folder(models, tmp_path) -> None:
    out = tmp_path / "dec"
    base = ("decompose", "--model", str(models.dense), "--method", "svd", "--out", str(out), "--overwrite")
    assert run_cli(*base, "--ratio", "0.5", tmp=tmp_path).code == 0
    killed = run_cli(*base, "--ratio", "0.7", tmp=tmp_path, env={"DEINFER_MEGATRON_KILL_AT": "staging.after-publish"})
    assert killed.code == -signal.SIGKILL and not killed.survivors
    folder = open_model(out)  # the new folder is complete and verified; the old one awaits removal
    assert folder.manifest["ratio"] == 0.7
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".dec.")]
    rerun = run_cli(*base, "--ratio", "0.7", tmp=tmp_path)
    assert rerun.code == 0 and not [p for p in tmp_path.iterdir() if p.name.startswith(".dec.")]


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # what an attacker's checkpoint does on unpickling
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_checkpoint_runs_nothing(models, tmp_path) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    with open(ckpt / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", "wb") as f:
        torch.save({"args": _Payload(marker), "model": {}}, f, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    before = snapshot(ckpt)
    result = run_cli("decompose", "--model", str(ckpt), "--tokenizer", str(models.dense), "--method", "svd",
                     "--ratio", "0.5", "--out", str(tmp_path / "o"), tmp=tmp_path)
    assert_one_line_error(result)
    assert not marker.exists() and not (tmp_path / "o").exists()
    assert snapshot(ckpt) == before
