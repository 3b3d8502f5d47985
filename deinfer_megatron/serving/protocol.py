"""The OpenAI request fields the server reads, checked once, and the response bodies it writes.

A body is checked here, before anything is queued: a field of the wrong type or out of range is
an ``ApiError`` naming the field (HTTP 400, OpenAI's error JSON), so a bad request never reaches
the model loop. Fields the server does not implement are refused rather than ignored when
ignoring them would change the answer (``logprobs``, ``echo``, ``best_of``, ``suffix``, tools).
"""

from __future__ import annotations

import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

from deinfer_megatron.generation.sampling import SamplingParams


class ApiError(Exception):
    """An error the client caused (or must wait out): HTTP ``status`` with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


_UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "functions", "logit_bias",
                "response_format")


@dataclass(frozen=True)
class Completion:
    """A checked request: the prompt (text, or chat messages), how far and how to sample."""

    prompt: str | None
    messages: list[dict[str, str]] | None
    max_tokens: int
    sampling: tuple[SamplingParams, ...]  # one per choice (n)
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default: Any, *, integer: bool = False) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (not integer and not math.isfinite(value)):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    return tuple(stops)


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise ApiError(400, f"messages[{i}] must have a role (system, user or assistant) and a string "
                                "content", param="messages")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def parse_completion(body: Any, *, chat: bool, model_name: str, default_max_tokens: int) -> Completion:
    """Check an OpenAI completions (``chat=False``) or chat-completions body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") != model_name:
        raise ApiError(404, f"model {body.get('model')!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False, 0):
            raise ApiError(400, f"'{name}' is not supported by this server; leave it out", param=name)
    prompt, messages = None, None
    if chat:
        messages = _messages(body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, default_max_tokens, integer=True)
    if max_tokens < 1:
        raise ApiError(400, f"'{key}' must be at least 1, got {max_tokens}", param=key)
    n = _number(body, "n", 1, integer=True)
    if n < 1:
        raise ApiError(400, f"'n' must be at least 1, got {n}", param="n")
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise ApiError(400, f"'temperature' must be between 0 and 2, got {temperature}", param="temperature")
    top_p = _number(body, "top_p", 1.0)
    top_k = _number(body, "top_k", 0, integer=True)
    seed = _number(body, "seed", None, integer=True)
    base = random.randrange(2**62) if seed is None else seed
    try:
        sampling = tuple(SamplingParams.from_options(temperature=temperature, top_k=top_k, top_p=top_p,
                                                     seed=base + i) for i in range(n))
    except ValueError as err:
        raise ApiError(400, str(err).replace("--top-k", "'top_k'").replace("--top-p", "'top_p'")
                       .replace("--temperature", "'temperature'")) from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    return Completion(prompt, messages, max_tokens, sampling, _stop(body), stream,
                      bool(isinstance(options, dict) and options.get("include_usage")))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(index: int, text: str, finish_reason: str | None, *, chat: bool, stream: bool) -> dict[str, Any]:
    """One choice of a response (``stream``: of a chunk), in the completions or chat format."""
    if not chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    body = {"role": "assistant", "content": text} if not stream else ({"content": text} if text else {})
    return {"index": index, "delta" if stream else "message": body, "logprobs": None, "finish_reason": finish_reason}


def envelope(rid: str, model: str, choices: list, *, chat: bool, stream: bool,
             usage_counts: dict | None) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    out: dict[str, Any] = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage_counts is not None or not stream:
        out["usage"] = usage_counts
    return out
