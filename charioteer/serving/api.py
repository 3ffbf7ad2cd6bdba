"""The FastAPI application: OpenAI-compatible completions and chat, /health, /metrics."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from charioteer.engine.llm_engine import LLMEngine
from charioteer.serving import protocol
from charioteer.serving.async_engine import AsyncEngine, Delta, EngineError, QueueFull, RequestStream
from charioteer.serving.metrics import ServerMetrics
from charioteer.serving.protocol import APIError

log = logging.getLogger("charioteer.serving")


@dataclass
class ServerConfig:
    model_name: str | None = None  # the name clients send; default: the engine's model name
    aliases: tuple[str, ...] = ()  # other accepted names (e.g. the --model spec)
    api_key: str | None = None
    max_queue: int = 256  # requests waiting beyond the max_num_seqs that run
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def build_app(engine: LLMEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    model_name = config.model_name or engine.model_config.name
    names = {model_name, *config.aliases}
    metrics = ServerMetrics(model_name)
    async_engine = AsyncEngine(engine, metrics, max_queue=config.max_queue)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="Charioteer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.model_name = model_name

    # ---- errors, auth -------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(protocol.error_body(str(exc.detail), kind, None, None), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):  # pragma: no cover - a bug
        log.exception("unhandled error")
        return JSONResponse(protocol.error_body(f"internal error: {type(exc).__name__}", "internal_error"),
                            status_code=500)

    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)

    # ---- helpers ------------------------------------------------------------------------------

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        limit = config.max_body_bytes
        too_big = APIError(413, f"request body is over the {limit}-byte limit", "invalid_request_error",
                           None, "request_too_large")
        if length is not None:
            try:
                if int(length) > limit:
                    raise too_big
            except ValueError:
                raise protocol.bad_request("bad Content-Length header") from None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise APIError(404, f"the model '{name}' does not exist: this server serves '{model_name}'",
                           "invalid_request_error", "model", "model_not_found")

    async def submit(prompt, params, messages, auto_max_tokens, arrival, prefix) -> RequestStream:
        if not async_engine.alive:
            raise APIError(503, "the engine is not running", "server_error", None, "engine_dead")
        try:
            return await async_engine.submit(prompt, params, messages=messages, auto_max_tokens=auto_max_tokens,
                                             arrival_time=arrival, prefix=prefix)
        except QueueFull as exc:
            raise APIError(503, f"server overloaded: {exc}; retry later", "server_overloaded", None, "queue_full",
                           {"Retry-After": str(config.retry_after_s)}) from None
        except ValueError as exc:
            message = str(exc)
            param = "max_tokens" if "max_tokens" in message else ("messages" if messages is not None else "prompt")
            raise protocol.bad_request(message, param=param) from None

    async def collect(request: Request, stream: RequestStream) -> list[Delta]:
        """All deltas of a non-streaming request; aborts it if the client goes away."""
        deltas: list[Delta] = []

        async def watch():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    stream.close()
                    return

        watcher = asyncio.create_task(watch())
        try:
            while True:
                delta = await stream.next()
                if delta is None:  # nobody is listening any more
                    raise APIError(499, "client disconnected", "invalid_request_error", None, "client_closed")
                deltas.append(delta)
                if delta.finished:
                    return deltas
        except EngineError as exc:
            raise APIError(500, str(exc), "internal_error", None, "engine_error") from None
        finally:
            watcher.cancel()
            stream.close()

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def completion_logprobs(deltas: list[Delta], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for d in deltas:
            for lp in d.logprobs or []:
                tokens.append(lp.token)
                token_lps.append(lp.logprob)
                tops.append({t: v for t, v in lp.top})
                offsets.append(offset)
                offset += len(lp.token)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(deltas: list[Delta]) -> dict:
        content = []
        for d in deltas:
            for lp in d.logprobs or []:
                content.append({"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
                                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                                 for t, v in lp.top]})
        return {"content": content}

    # ---- endpoints ----------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if not async_engine.alive:
            return JSONResponse(protocol.error_body("the engine is not running", "server_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "charioteer",
            "root": engine.args.model or model_name, "max_model_len": engine.max_model_len,
        }]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        req = protocol.parse_body(await read_body(request), protocol.CompletionRequest)
        check_model(req.model)
        protocol.check_completion(req)
        prompt = protocol.completion_prompt(req)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        params = protocol.sampling_params(req, max_tokens, req.logprobs)
        stream = await submit(prompt, params, None, False, arrival, "cmpl")
        rid, now = stream.request_id, int(time.time())

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            offset = 0

            def chunk(delta: Delta) -> dict:
                nonlocal offset
                choice = {"index": 0, "text": delta.text, "logprobs": None,
                          "finish_reason": delta.finish_reason if delta.finished else None}
                if req.logprobs is not None:
                    choice["logprobs"] = completion_logprobs([delta], offset)
                offset += len(delta.text)
                body = {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                        "choices": [choice]}
                if include_usage:
                    body["usage"] = None
                return body

            def final(last: Delta) -> list[dict]:
                if not include_usage:
                    return []
                return [{"id": rid, "object": "text_completion", "created": now, "model": model_name,
                         "choices": [], "usage": usage(last.prompt_tokens, last.completion_tokens)}]

            return SSEResponse(stream, chunk, final, [])

        deltas = await collect(request, stream)
        last = deltas[-1]
        choice = {"index": 0, "text": "".join(d.text for d in deltas), "logprobs": None,
                  "finish_reason": last.finish_reason}
        if req.logprobs is not None:
            choice["logprobs"] = completion_logprobs(deltas, 0)
        return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                "choices": [choice], "usage": usage(last.prompt_tokens, last.completion_tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req = protocol.parse_body(await read_body(request), protocol.ChatCompletionRequest)
        check_model(req.model)
        protocol.check_chat(req)
        messages = protocol.chat_messages(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = protocol.sampling_params(req, max_tokens, logprobs)
        stream = await submit(None, params, messages, max_tokens is None, arrival, "chatcmpl")
        rid, now = stream.request_id, int(time.time())

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def base() -> dict:
                body = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name}
                if include_usage:
                    body["usage"] = None
                return body

            def chunk(delta: Delta) -> dict:
                choice = {"index": 0, "delta": {"content": delta.text} if delta.text or not delta.finished else {},
                          "logprobs": chat_logprobs([delta]) if req.logprobs else None,
                          "finish_reason": delta.finish_reason if delta.finished else None}
                return {**base(), "choices": [choice]}

            def final(last: Delta) -> list[dict]:
                if not include_usage:
                    return []
                return [{**base(), "choices": [], "usage": usage(last.prompt_tokens, last.completion_tokens)}]

            first = {**base(), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            return SSEResponse(stream, chunk, final, [first])

        deltas = await collect(request, stream)
        last = deltas[-1]
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                  "logprobs": chat_logprobs(deltas) if req.logprobs else None, "finish_reason": last.finish_reason}
        return {"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                "choices": [choice], "usage": usage(last.prompt_tokens, last.completion_tokens)}

    return app


class APIKeyMiddleware:
    """401 for /v1 requests without `Authorization: Bearer <key>` (plain ASGI: keeps streaming intact)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    given = value
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                response = _error_response(APIError(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error",
                    None, "invalid_api_key", {"WWW-Authenticate": "Bearer"}))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(Response):
    """Server-sent events for one request: `data: {json}` chunks, then `data: [DONE]`.

    Watches the connection while streaming: a client that goes away aborts its request at
    once (the engine frees its KV blocks before its next step), not at the next token.
    """

    media_type = "text/event-stream"

    def __init__(self, stream: RequestStream, chunk, final, head: list[dict]) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.stream, self.chunk, self.final, self.head = stream, chunk, final, head

    async def __call__(self, scope, receive, send) -> None:
        stream = self.stream

        async def watch():
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    stream.close()
                    return

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            for obj in self.head:
                await send({"type": "http.response.body", "body": _sse(obj), "more_body": True})
            while True:
                try:
                    delta = await stream.next()
                except EngineError as exc:
                    await send({"type": "http.response.body", "more_body": True,
                                "body": _sse(protocol.error_body(str(exc), "internal_error", None, "engine_error"))})
                    break
                if delta is None:  # client gone
                    return
                if delta.text or delta.finished or delta.logprobs:
                    await send({"type": "http.response.body", "body": _sse(self.chunk(delta)), "more_body": True})
                if delta.finished:
                    for obj in self.final(delta):
                        await send({"type": "http.response.body", "body": _sse(obj), "more_body": True})
                    break
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except OSError:  # the connection broke while sending
            pass
        finally:
            watcher.cancel()
            stream.close()
