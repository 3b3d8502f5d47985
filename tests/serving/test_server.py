"""``deinfer-megatron serve`` at TP=2 (local ranks, tiny LLaMA sharing SmolLM2's tokenizer)
driven by the real ``openai`` client, against Hugging Face ``generate`` on each prompt alone.

One server answers every API check and is then drained with SIGTERM; a second one (DeepSpeed-
Inference engine, latent cache) answers as Hugging Face does and then loses a rank under load. A server start costs ~20 s, so each is used for as much as it can show.
The model keeps layer 0's attention dense (as an allocation that finds its factors no smaller
leaves it): Megatron's attention pages its K/V beside the decomposed blocks' K/V or latents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import transformers

from deinfer_megatron.bench.serve_load import LoadSpec, make_requests, run_server_load
from tests.helpers.serving import ROOT, Server
from tests.helpers.tiny_models import full_rank_folders

EXAMPLE = ROOT / "examples" / "serve_client.py"
KEY = "sk-test-key"
WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars shine above quiet hills".split()
PROMPTS = [" ".join(WORDS[i % 5 : i % 5 + 2 + i]) for i in range(16)]
MAX_TOKENS = [4 + (i * 5) % 16 for i in range(16)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    hf, _, dec = full_rank_folders(root, "llama", dense_attention=(0,))
    tokenizer = transformers.AutoTokenizer.from_pretrained(dec)

    def reference(ids: list[int], max_tokens: int) -> str:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    return dec, tokenizer, reference, root


def client(server: Server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=120)


def check_greedy_concurrent(api: openai.OpenAI, name: str, tokenizer, reference) -> None:
    def one(i: int):
        return api.completions.create(model=name, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(16)))
    for i, answer in enumerate(answers):
        ids = tokenizer(PROMPTS[i])["input_ids"]
        assert answer.choices[0].text == reference(ids, MAX_TOKENS[i]), PROMPTS[i]
        assert answer.usage.prompt_tokens == len(ids)
        assert answer.usage.total_tokens == len(ids) + answer.usage.completion_tokens


def check_stream_stop_max_tokens_seed_n_chat(api: openai.OpenAI, name: str, tokenizer, reference) -> None:
    full = api.completions.create(model=name, prompt=PROMPTS[3], max_tokens=12, temperature=0)
    chunks = list(api.completions.create(model=name, prompt=PROMPTS[3], max_tokens=12, temperature=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12  # max_tokens

    text = full.choices[0].text
    stop = text[4:7]
    cut = api.completions.create(model=name, prompt=PROMPTS[3], max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = api.completions.create(model=name, prompt=PROMPTS[3], max_tokens=12, temperature=0, stop=stop,
                                      stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text

    sampled = [api.completions.create(model=name, prompt=PROMPTS[5], max_tokens=10, temperature=0.9, seed=7, n=3)
               for _ in range(2)]
    texts = [[c.text for c in sorted(s.choices, key=lambda c: c.index)] for s in sampled]
    assert texts[0] == texts[1], "the same seed draws the same choices"
    assert len(set(texts[0])) > 1, "the n choices are drawn independently"
    assert sampled[0].usage.completion_tokens == 30

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = api.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    assert chat.choices[0].message.content == reference(list(ids), 8)
    assert chat.usage.prompt_tokens == len(ids)
    parts = list(api.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                             stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.choices[0].message.content


def check_bad_requests(server: Server, api: openai.OpenAI, name: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    bad = httpx.post(f"{server.url}/completions", content=b"{not json", headers=auth)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    cases = [(dict(model="nope", prompt="a"), openai.NotFoundError, "does not exist"),
             (dict(model=name, prompt="a", max_tokens=0), openai.BadRequestError, "max_tokens"),
             (dict(model=name, prompt="word " * 200, max_tokens=4), openai.BadRequestError, "exceeds the context"),
             (dict(model=name, prompt="a", temperature=-1), openai.BadRequestError, "temperature")]
    for kwargs, error, text in cases:
        with pytest.raises(error, match=text):
            api.completions.create(**kwargs)
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong-key").completions.create(model=name, prompt="a", max_tokens=2)
    assert httpx.get(f"{server.url}/models").status_code == 401  # the key guards every endpoint…
    assert httpx.get(server.url.replace("/v1", "/health")).status_code == 200  # …but /health
    assert [m.id for m in api.models.list().data] == [name]
    ok = api.completions.create(model=name, prompt="still serving", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def check_flood(server: Server, api: openai.OpenAI, name: str) -> None:
    def one(i: int):
        try:
            return api.completions.create(model=name, prompt=PROMPTS[i % 16], max_tokens=40, temperature=0)
        except openai.RateLimitError:
            return None

    with ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(one, range(40)))
    served = [a for a in answers if a is not None]
    assert len(served) < 40, "past --max-queue requests are refused with 429"
    assert len(served) >= 16, "the queue and the running batch were all served"
    assert all(a.usage.completion_tokens == 40 and a.choices[0].finish_reason == "length" for a in served)
    metrics = httpx.get(server.url.replace("/v1", "/metrics"), headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'deinfer_requests_total{status="429"}' in metrics
    assert "deinfer_time_to_first_token_seconds_count" in metrics


def check_example(server: Server, tokenizer, reference) -> None:
    """examples/serve_client.py, run as a user runs it, against this server."""
    env = {**os.environ, "DEINFER_API_KEY": KEY}
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--base-url", server.url, "--model", "tiny",
                           "--prompt", PROMPTS[2], "--max-tokens", "6"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["completion"] == out["streamed"] == reference(tokenizer(PROMPTS[2])["input_ids"], 6)
    assert out["usage"]["completion_tokens"] == 6


def check_load(server: Server) -> None:
    """``loadgen``'s server side: every request answered, the tokens the server counted."""
    requests = make_requests(LoadSpec(requests=8, rate=50, concurrency=4, prompt_words=(2, 10), output_tokens=(2, 8)))
    report = run_server_load(server.url, "tiny", requests, 4, KEY)
    assert report["completed"] == 8 and report["errors"] == 0
    assert report["completion_tokens"] == sum(r.max_tokens for r in requests)
    assert 0 < report["ttft_s"]["p50"] <= report["ttft_s"]["p99"] <= report["e2e_s"]["p99"]


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.url.replace("/v1", "/metrics"), headers={"Authorization": f"Bearer {KEY}"}).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def check_disconnect_frees_the_slot(server: Server) -> None:
    """A client that goes away mid-stream: its sequence leaves the batch, long before max_tokens."""
    before = metric(server, "deinfer_generation_tokens_total")
    body = {"model": "tiny", "prompt": "go on", "max_tokens": 110, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 30
    while metric(server, "deinfer_running_sequences") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "deinfer_running_sequences") == 0
    assert metric(server, "deinfer_generation_tokens_total") - before < 110


def check_sigterm_drains(server: Server, api: openai.OpenAI, name: str) -> None:
    streams = [api.completions.create(model=name, prompt=PROMPTS[i], max_tokens=40, temperature=0, stream=True)
               for i in range(3)]
    firsts = [next(iter(s)) for s in streams]  # all three are running
    server.terminate()
    time.sleep(0.5)
    with pytest.raises((openai.APIStatusError, openai.APIConnectionError)):
        api.completions.create(model=name, prompt="too late", max_tokens=2)
    for first, stream in zip(firsts, streams):
        rest = list(stream)
        assert rest[-2].choices[0].finish_reason == "length" and rest[-1].usage.completion_tokens == 40
    assert server.proc.wait(timeout=60) == 0


def test_openai_client_against_tp2_server(model) -> None:
    dec, tokenizer, reference, root = model
    server = Server(dec, "--tp", "2", "--max-batch", "4", "--max-queue", "16", "--api-key", KEY,
                    "--served-model-name", "tiny", log=root / "server-a.log")
    try:
        api = client(server)
        check_greedy_concurrent(api, "tiny", tokenizer, reference)
        check_stream_stop_max_tokens_seed_n_chat(api, "tiny", tokenizer, reference)
        check_bad_requests(server, api, "tiny")
        check_flood(server, api, "tiny")
        check_example(server, tokenizer, reference)
        check_load(server)
        check_disconnect_frees_the_slot(server)
        check_sigterm_drains(server, api, "tiny")
    finally:
        server.stop()


def test_a_rank_killed_under_load_ends_the_deepspeed_server(model) -> None:
    import signal

    dec, tokenizer, reference, root = model
    server = Server(dec, "--tp", "2", "--kv-cache", "latent", "--engine", "deepspeed", log=root / "server-b.log")
    try:
        api = client(server, "unused")
        name = dec.name
        answer = api.completions.create(model=name, prompt=PROMPTS[7], max_tokens=6, temperature=0)
        assert answer.choices[0].text == reference(tokenizer(PROMPTS[7])["input_ids"], 6)  # DeepSpeed, latent
        streams = [api.completions.create(model=name, prompt=PROMPTS[i], max_tokens=100, temperature=0,
                                          stream=True) for i in range(2)]
        for s in streams:
            next(iter(s))
        ranks = server.ranks()
        assert len(ranks) == 2, ranks
        start = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        for s in streams:
            with pytest.raises((openai.APIError, httpx.HTTPError)):
                list(s)  # the stream breaks off: an error, not a silent end
        code = server.proc.wait(timeout=60)
        assert code != 0 and time.monotonic() - start < 60
        assert "died" in (root / "server-b.log").read_text()
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("/v1", "/health"), timeout=2)
    finally:
        server.stop()
