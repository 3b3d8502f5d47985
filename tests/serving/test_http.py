"""The HTTP layer in one process (FastAPI's test client, no model): what the API says when the
ranks have failed, and errors the running-server tests do not reach."""

from __future__ import annotations

from fastapi.testclient import TestClient

from deinfer_megatron.serving.blocks import BlockManager
from deinfer_megatron.serving.http import ServerState, build_app
from deinfer_megatron.serving.metrics import ServerMetrics
from deinfer_megatron.serving.scheduler import Scheduler


def app(healthy: bool) -> TestClient:
    scheduler = Scheduler(pool=BlockManager(16, 4), max_running=2, max_seq_len=32, max_queue=2, decode=str,
                          eos_ids=frozenset())
    state = ServerState(scheduler=scheduler, encode=lambda c: [1, 2, 3], model_name="m", api_key=None,
                        metrics=ServerMetrics(kv_bytes=0), default_max_tokens=4, healthy=lambda: healthy)
    return TestClient(build_app(state))


def test_failed_ranks_fail_health_and_requests() -> None:
    client = app(healthy=False)
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
    answer = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert answer.status_code == 503 and "not running" in answer.json()["error"]["message"]


def test_errors_are_openai_json() -> None:
    client = app(healthy=True)
    cases = [
        (client.get("/v1/nothing"), 404, "Not Found"),
        (client.post("/v1/completions", json={"model": "m", "prompt": "x", "logprobs": 2}), 400, "'logprobs' is not supported"),
        (client.post("/v1/completions", json=[1, 2]), 400, "must be a JSON object"),
        (client.post("/v1/completions", json={"model": "m", "prompt": ""}), 400, "'prompt' must be a non-empty string"),
        (client.post("/v1/completions", json={"model": "m", "prompt": "x", "n": 0}), 400, "'n' must be at least 1"),
        (client.post("/v1/completions", json={"model": "m", "prompt": "x", "n": 3}), 400, "n = 3 exceeds"),
        (client.post("/v1/completions", json={"model": "m", "prompt": "x", "top_p": 0}), 400, "'top_p' must be in"),
        (client.post("/v1/completions", json={"model": "m", "prompt": "x", "stop": ["a", 1]}), 400, "'stop'"),
        (client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "x", "content": "y"}]}),
         400, "messages[0]"),
        (client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": "5"}), 400, "an integer"),
    ]
    for response, status, text in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert text in error["message"] and set(error) == {"message", "type", "param", "code"}
    metrics = client.get("/metrics").text
    assert 'deinfer_requests_total{status="400"} 9.0' in metrics
