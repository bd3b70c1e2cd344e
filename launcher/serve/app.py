"""The HTTP face: OpenAI's routes, bearer-token auth, back-pressure, SSE streams, errors in
OpenAI's JSON, /health and /metrics. It talks to a backend with EngineHandler's methods: the
handler itself on one machine, or the Ray Serve router (ray_app.py) in front of replicas."""
from __future__ import annotations

import asyncio
import json
import secrets
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from engine import EngineError, InvalidRequestError, RankFailure
from launcher.serve.metrics import ServerMetrics
from launcher.serve.protocol import ChatRequest, CompletionRequest, ServeError

DISCONNECT_POLL_S = 0.2


class Gate:
    """At most `limit` requests in the server at once, running or waiting for the engine;
    one more is refused at once (429) rather than queued without bound."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    def enter(self) -> None:
        if self.held >= self.limit:
            raise ServeError(429, f"the server holds {self.held} requests, its limit "
                             f"(serve.max_queued={self.limit}); retry later", "rate_limit_error",
                             code="rate_limit_exceeded")
        self.held += 1

    def leave(self) -> None:
        self.held -= 1


def build_app(backend, api_key: str | None = None, max_queued: int = 256) -> FastAPI:
    app = FastAPI(title="prefill-engine", docs_url=None, redoc_url=None)
    metrics, gate = ServerMetrics(backend.model_name), Gate(max_queued)
    app.state.backend, app.state.metrics, app.state.gate = backend, metrics, gate

    @app.exception_handler(ServeError)
    async def refused(request: Request, e: ServeError):
        if e.status in (429, 503):
            metrics.rejected.labels(backend.model_name, str(e.status)).inc()
        return _error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # e.g. 404 for an unknown path
        return _error_response(ServeError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception):
        return _error_response(ServeError(500, f"internal error: {type(e).__name__}: {e}",
                                          "server_error"))

    def key_check(request: Request) -> None:
        _check_key(request, api_key)

    authorized = [Depends(key_check)]

    @app.get("/v1/models", dependencies=authorized)
    async def models():
        return {"object": "list", "data": [{"id": backend.model_name, "object": "model",
                                            "owned_by": "prefill-engine", "created": 0}]}

    @app.get("/health")
    async def health():
        stats = await backend.stats()
        down = [i for i, s in enumerate(stats) if not s["up"]]
        if down:
            return JSONResponse({"status": "down", "replicas_down": down}, status_code=503)
        return {"status": "ok", "replicas": len(stats)}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(await backend.stats()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest, backend.model_name)
        return await _serve(request, req, backend.completion, backend.completion_chunks,
                            metrics, gate)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat(request: Request):
        req = await _parse(request, ChatRequest, backend.model_name)
        return await _serve(request, req, backend.chat, backend.chat_chunks, metrics, gate)

    return app


def _check_key(request: Request, api_key: str | None) -> None:
    if not api_key:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise ServeError(401, "missing or wrong API key: send it as 'Authorization: Bearer "
                         "<key>'", "invalid_request_error", code="invalid_api_key")


async def _parse(request: Request, model, served: str):
    try:
        req = model.model_validate_json(await request.body())
    except ValidationError as e:
        raise ServeError(400, "; ".join(_describe(err) for err in e.errors()[:5])) from None
    if req.model is not None and req.model != served:
        raise ServeError(404, f"the model {req.model!r} does not exist here; this server serves "
                         f"{served!r} (GET /v1/models)", code="model_not_found", param="model")
    return req


def _describe(err: dict) -> str:
    where = ".".join(str(p) for p in err["loc"]) or "body"
    return f"{where}: {err['msg']}"


async def _serve(request: Request, req, whole, chunks, metrics: ServerMetrics, gate: Gate):
    gate.enter()
    if not req.stream:
        try:
            body = await _until_disconnect(request, _engine_errors(whole(req)))
        finally:
            gate.leave()
        metrics.observe(body.pop("_timing"), body["usage"])
        return body
    stream = None

    async def release() -> None:
        gate.leave()
        if stream is not None:
            await stream.aclose()  # cancels the engine's request if it started and still runs

    try:
        stream = chunks(req)  # a backend may refuse here, before its stream exists (the router)
        # the first chunk before the headers: a bad request still gets its status code
        first = await _until_disconnect(request, _engine_errors(anext(stream)))
    except BaseException:
        await release()
        raise
    return EventStream(_sse(first, stream, req.include_usage, metrics), release)


class EventStream(StreamingResponse):
    """Server-sent events that release the request however the response ends: also when the
    client is gone as the headers go out, so that the events are never read (a generator never
    started runs no `finally`)."""

    def __init__(self, events: AsyncIterator[str], release: Callable[[], Awaitable[None]]):
        super().__init__(events, media_type="text/event-stream")
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.release()


async def _sse(first: dict, stream: AsyncIterator[dict], include_usage: bool,
               metrics: ServerMetrics) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, then `data: [DONE]`. A client gone closes
    this generator and the response releases the engine's stream: the request is cancelled."""
    try:
        chunk = first
        while chunk is not None:
            if "_timing" in chunk:  # the closing chunk: usage and timing
                metrics.observe(chunk.pop("_timing"), chunk["usage"])
                if include_usage:
                    yield _event(chunk)
            else:
                yield _event(chunk)
            chunk = await _engine_errors(anext(stream, None))
    except ServeError as e:  # after the headers went out: the error is the stream's last event
        yield _event(e.body())
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _engine_errors(awaitable):
    """The engine's refusals as HTTP errors: bad input 400, a failed rank 503."""
    try:
        return await awaitable
    except RankFailure as e:
        raise ServeError(503, str(e), "service_unavailable") from None
    except InvalidRequestError as e:
        raise ServeError(400, str(e)) from None
    except EngineError as e:
        raise ServeError(500, str(e), "server_error") from None


async def _until_disconnect(request: Request, awaitable):
    """Await it, but cancel it (and so the engine's request) if the client goes away."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise ServeError(499, "the client closed the connection")
        return task.result()
    finally:
        if not task.done():
            task.cancel()


def _error_response(e: ServeError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)
