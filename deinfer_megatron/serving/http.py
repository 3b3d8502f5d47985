"""The OpenAI-compatible HTTP API (FastAPI), in front of the scheduler.

Handlers run on uvicorn's event loop in a thread of rank 0; the model loop runs in rank 0's main
thread. A request's events cross over through ``loop.call_soon_threadsafe`` into an
``asyncio.Queue`` of its own. A client that goes away — its stream is cancelled, or a
non-streamed request sees the disconnect — cancels its request, whose KV blocks are freed at
the next step.

Every endpoint but ``/health`` needs ``Authorization: Bearer <key>`` when the server has a key.
Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``) with a 4xx/5xx
status; the server keeps serving after any of them.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deinfer_megatron.serving.metrics import ServerMetrics
from deinfer_megatron.serving.protocol import ApiError, Completion, choice, envelope, new_id, parse_completion, usage
from deinfer_megatron.serving.scheduler import Draining, Event, QueueFull, Request, Scheduler
from deinfer_megatron.serving.stats import StepStats


@dataclass
class ServerState:
    """What the handlers need: the scheduler, how to turn text into ids, names and limits."""

    scheduler: Scheduler
    encode: Callable[[Completion], list[int]]  # the prompt (chat template applied) → ids
    model_name: str
    api_key: str | None
    metrics: ServerMetrics
    default_max_tokens: int
    healthy: Callable[[], bool]
    stats: StepStats | None = None  # the model loop's step totals (None: no loop, as in tests)


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse(ApiError(status, message, kind=kind, code=code).body(), status_code=status)


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application of one server."""
    app = FastAPI(title="deinfer-megatron", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def authorize_and_count(request: HttpRequest, call_next: Any) -> Response:
        if state.api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                response: Response = _error(401, "invalid or missing API key; send Authorization: Bearer <key>",
                                            code="invalid_api_key")
                state.metrics.requests.labels(status="401").inc()
                return response
        response = await call_next(request)
        state.metrics.requests.labels(status=str(response.status_code)).inc()
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, err: StarletteHTTPException) -> JSONResponse:
        return _error(err.status_code, f"{request.method} {request.url.path}: {err.detail}")

    @app.get("/health")
    async def health() -> Response:
        if state.healthy():
            return JSONResponse({"status": "ok"})
        return _error(503, "the model ranks are not running", kind="server_error")

    @app.get("/metrics")
    async def metrics() -> Response:
        s = state.scheduler
        state.metrics.observe_batch(s.queue_length, s.running, s.pool)
        if state.stats is not None:
            state.metrics.observe_steps(state.stats)
        return Response(state.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "deinfer-megatron"}]}

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Response:
        return await _complete(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest) -> Response:
        return await _complete(state, request, chat=True)

    return app


async def _body(request: HttpRequest) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None


def _admit(state: ServerState, completion: Completion, prompt: list[int],
           sink: Callable[[Event], None]) -> Request:
    request = Request(prompt=prompt, max_tokens=completion.max_tokens, sampling=list(completion.sampling),
                      sink=sink, stop=completion.stop)
    if not state.healthy():
        raise ApiError(503, "the model ranks are not running", kind="server_error")
    try:
        state.scheduler.submit(request)
    except QueueFull as err:
        raise ApiError(429, str(err), kind="rate_limit_error", code="queue_full") from None
    except Draining as err:
        raise ApiError(503, str(err), kind="server_error") from None
    except ValueError as err:  # longer than the context or the pool, or more choices than may run
        raise ApiError(400, str(err)) from None
    return request


async def _complete(state: ServerState, http: HttpRequest, *, chat: bool) -> Response:
    completion = parse_completion(await _body(http), chat=chat, model_name=state.model_name,
                                  default_max_tokens=state.default_max_tokens)
    try:
        prompt = state.encode(completion)
    except ValueError as err:
        raise ApiError(400, str(err), param="messages" if chat else "prompt") from None
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def sink(event: Event) -> None:  # called from the model loop's thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: the server stopped, nobody listens
            pass

    request = _admit(state, completion, prompt, sink)
    rid = new_id("chatcmpl" if chat else "cmpl")
    if completion.stream:
        return StreamingResponse(_stream(state, request, events, rid, chat), media_type="text/event-stream")
    texts, reasons = [""] * request.n, [None] * request.n
    try:
        while any(r is None for r in reasons):
            try:
                event = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    state.scheduler.cancel(request)
                    return Response(status_code=499)
                continue
            if event.kind == "error":
                raise ApiError(503, event.message, kind="server_error")
            texts[event.index] += event.text
            if event.kind == "done":
                reasons[event.index] = event.finish_reason
    except asyncio.CancelledError:
        state.scheduler.cancel(request)
        raise
    choices = [choice(i, t, r, chat=chat, stream=False) for i, (t, r) in enumerate(zip(texts, reasons))]
    return JSONResponse(envelope(rid, state.model_name, choices, chat=chat, stream=False,
                                 usage_counts=usage(len(prompt), request.completion_tokens)))


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def _stream(state: ServerState, request: Request, events: asyncio.Queue, rid: str,
                  chat: bool) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk format; the last chunk carries the usage."""
    name, open_choices = state.model_name, set(range(request.n))
    try:
        if chat:
            first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(request.n)]
            yield _sse(envelope(rid, name, first, chat=True, stream=True, usage_counts=None))
        while open_choices:
            event = await events.get()
            if event.kind == "error":
                yield _sse(ApiError(503, event.message, kind="server_error").body())
                return
            if event.kind == "done":
                open_choices.discard(event.index)
            if event.text or event.kind == "done":
                part = choice(event.index, event.text, event.finish_reason, chat=chat, stream=True)
                yield _sse(envelope(rid, name, [part], chat=chat, stream=True, usage_counts=None))
        yield _sse(envelope(rid, name, [], chat=chat, stream=True,
                            usage_counts=usage(len(request.prompt), request.completion_tokens)))
        yield _sse("[DONE]")
    finally:
        if open_choices:  # the client went away (or the ranks failed): free its blocks
            state.scheduler.cancel(request)

