"""``serve``'s KV pool as a user meets it: its flags' bad values, a pool too full for new
requests, and a rank killed under load — each as a real process (``harness.Job``), which must
leave no process behind.

A full pool never hurts the requests that hold it: newcomers wait in the queue, or get 429 past
``--max-queue``, and every answer — of the requests that held the pool and of those that waited
for it — equals Hugging Face ``generate`` on its prompt alone. The waiting ones find the prompt
prefix the others share in the prefix cache (``/metrics``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import transformers

from deinfer_megatron.launch.local import free_port
from tests.robustness.harness import Job
from tests.robustness.test_inputs import cli_error

SYSTEM = "You are a careful assistant. Answer briefly and plainly, in one sentence:"
USERS = ("Alice", "Bob", "Carol")  # each long request's prompt starts apart: they share no block
LONG = [f"{u} says: {SYSTEM} tell me about {w}" for u, w in zip(USERS, ("rivers", "mountains", "forests"))]
SHORT = [f"{USERS[i % 3]} says: {SYSTEM} name a {w}"
         for i, w in enumerate(("colour", "fruit", "planet", "metal", "bird"))]
LONG_TOKENS, LONG_CHUNKS, SHORT_TOKENS, BLOCK = 1900, 40, 6, 4


def test_bad_pool_flags_are_one_line(models, capfd) -> None:
    serve = ("serve", "--model", models.decomposed)
    assert "--block-size must be at least 1, got 0" in cli_error(capfd, *serve, "--block-size", "0")
    line = cli_error(capfd, *serve, "--block-size", "512", "--max-seq-len", "256")
    assert "--block-size 512 exceeds the 256 tokens" in line
    line = cli_error(capfd, *serve, "--kv-budget-gb", "1e-9")
    assert "--kv-budget-gb 1e-09 holds no KV block of 16 tokens" in line and "raise --kv-budget-gb" in line
    line = cli_error(capfd, "loadgen", "--url", "http://127.0.0.1:1/v1", "--served-model-name", "m",
                     "--system-words", "-1")
    assert "--system-words must be ≥ 0, got -1" in line
    assert "--prefill-chunk must be at least 1, got 0" in cli_error(capfd, *serve, "--prefill-chunk", "0")
    loadgen = ("loadgen", "--url", "http://127.0.0.1:1/v1", "--served-model-name", "m")
    assert "--profile needs --static-model" in cli_error(capfd, *loadgen, "--profile")
    line = cli_error(capfd, *loadgen, "--static-model", models.decomposed, "--profile", "0")
    assert "--profile CHUNK must be at least 1 prompt token, got 0" in line


def _start(models, tmp_path: Path, *args: str) -> tuple[Job, str]:
    port = free_port()
    job = Job("serve", "--model", str(models.decomposed), "--port", str(port), *args, tmp=tmp_path)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        assert job.proc.poll() is None, f"serve exited: {job.proc.stderr.read()[-3000:]}"
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return job, base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "serve did not come up"
        time.sleep(0.5)


def _errors(stderr: str) -> list[str]:
    """stderr without the server's log lines."""
    return [line for line in stderr.strip().splitlines()
            if line.strip() and not line.startswith(("[rank 0] INFO", "[rank 0] WARNING"))]


def _stream(base: str, prompt: str, max_tokens: int, *, first: threading.Event | None = None,
            answered: threading.Event | None = None, hold: threading.Event | None = None,
            chunks: int | None = None) -> str | int:
    """A greedy streamed completion: its text, or the HTTP status that refused it. ``answered`` is
    set once the status is known (a queued request is answered 200 before its first token),
    ``first`` once text has come; then the reading waits for ``hold``, and stops (the client goes
    away) after ``chunks`` chunks."""
    body = {"model": "dec", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, read = "", 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as response:
        if answered is not None:
            answered.set()
        if response.status_code != 200:
            return response.status_code
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += "".join(c["text"] for c in chunk["choices"])
                read += 1
                if first is not None and text and not first.is_set():
                    first.set()
                    if hold is not None:
                        hold.wait(120)
                if chunks is not None and read >= chunks:
                    break
    return text


def _reference(models, prompts: list[str], max_tokens: int) -> list[str]:
    tok = transformers.AutoTokenizer.from_pretrained(models.decomposed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(models.dense, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=0)
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def test_a_full_pool_queues_or_refuses_and_corrupts_nobody(models, tmp_path) -> None:
    from deinfer_megatron.arch.model import load_arch
    from deinfer_megatron.planning.plan import make_plan
    from deinfer_megatron.specs.layout import Layout
    from deinfer_megatron.specs.rank_config import RankConfig

    tok = transformers.AutoTokenizer.from_pretrained(models.decomposed)
    arch = load_arch(models.decomposed)
    per_token = make_plan(arch, RankConfig.load(models.decomposed / "rank_config.json", arch), Layout.DEINFER
                          ).totals["kv_bytes_per_token"]["full"]
    blocks = sum(-(-(len(tok(p)["input_ids"]) + LONG_TOKENS) // BLOCK) for p in LONG) + 1
    budget = (blocks + 0.5) * BLOCK * per_token / 2**30  # the long requests hold all of it but a block
    job, base = _start(models, tmp_path, "--kv-budget-gb", f"{budget:.12f}", "--block-size", str(BLOCK),
                       "--max-queue", "2", "--served-model-name", "dec")
    try:
        started, hold = [threading.Event() for _ in LONG], threading.Event()
        with ThreadPoolExecutor(len(LONG) + len(SHORT)) as pool:
            longs = [pool.submit(_stream, base, p, LONG_TOKENS, first=e, hold=hold, chunks=LONG_CHUNKS)
                     for p, e in zip(LONG, started)]
            for event in started:
                assert event.wait(120), "every long request is generating"
            shorts = []
            for p in SHORT:  # one after the other, while the long ones hold the pool
                answered = threading.Event()
                shorts.append(pool.submit(_stream, base, p, SHORT_TOKENS, answered=answered))
                assert answered.wait(60)
            queued = httpx.get(f"{base}/metrics").text
            hold.set()  # the long ones read on, then go away: their blocks go to the waiting ones
            long_out, short_out = [f.result() for f in longs], [f.result() for f in shorts]
        metrics = httpx.get(f"{base}/metrics").text
        job.proc.send_signal(signal.SIGTERM)
        result = job.finish(timeout=120)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert result.code == 0 and not result.survivors, result.stderr[-3000:]
    assert "deinfer_queue_length 2.0" in queued and "deinfer_running_sequences 3.0" in queued, queued
    for out, expected in zip(long_out, _reference(models, LONG, LONG_CHUNKS + 8)):
        assert len(out) > 20 and expected.startswith(out), "the requests holding the pool are intact"
    refused = [i for i, out in enumerate(short_out) if out == 429]
    assert refused == [2, 3, 4], f"two newcomers wait, the ones past --max-queue 2 get 429: {short_out}"
    expected = _reference(models, SHORT, SHORT_TOKENS)
    for i, out in enumerate(short_out):
        if i not in refused:
            assert out == expected[i], f"request {i} waited for blocks and answered as alone"
    assert f'deinfer_requests_total{{status="429"}} {float(len(refused))}' in metrics
    hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("deinfer_prefix_cache_hits_total "))
    assert hits >= 2 * BLOCK, "the shared system prompt was found in the prefix cache"
    assert "deinfer_prefix_cache_hit_ratio" in metrics


def test_a_rank_killed_under_load_ends_the_server_in_one_line(models, tmp_path) -> None:
    job, base = _start(models, tmp_path, "--tp", "2", "--block-size", "8", "--served-model-name", "dec")
    try:
        started = [threading.Event() for _ in LONG]
        with ThreadPoolExecutor(len(LONG)) as pool:
            streams = [pool.submit(_stream, base, p, 1000, first=e) for p, e in zip(LONG, started)]
            for event in started:
                assert event.wait(120), "every request is generating"
            ranks = [pid for pid in job.processes() if pid != job.proc.pid
                     and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
                     and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
            assert len(ranks) == 2, ranks
            os.kill(max(ranks), signal.SIGKILL)
            killed_at = time.monotonic()
            for s in streams:
                with pytest.raises((AssertionError, httpx.HTTPError)):
                    s.result()  # the stream breaks off with an error event or a reset, never a quiet end
        result = job.finish(timeout=60)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert time.monotonic() - killed_at < 60
    assert result.code != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = _errors(result.stderr)
    assert len(errors) == 1 and "died" in errors[0] and "exit code -9" in errors[0], result.stderr[-3000:]
    assert not result.survivors, result.survivors
