"""The FastAPI application: OpenAI-compatible completions and chat, vLLM's /tokenize and /detokenize,
/health, /metrics, /dashboard."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import inspect
import json
import logging
import time
import uuid
import weakref
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from charioteer.engine.llm_engine import LLMEngine
from charioteer.serving import dashboard, protocol, replies, tokenization
from charioteer.serving.async_engine import AsyncEngine, Delta, EngineError, QueueFull, RequestStream
from charioteer.serving.metrics import ServerMetrics
from charioteer.serving.protocol import APIError
from charioteer.serving.stream_group import StreamGroup

log = logging.getLogger("charioteer.serving")


@dataclass
class ServerConfig:
    model_name: str | None = None  # the name clients send; default: the engine's model name
    aliases: tuple[str, ...] = ()  # other accepted names (e.g. the --model spec)
    api_key: str | None = None
    max_queue: int = 256  # requests waiting beyond the max_num_seqs that run
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1


def build_app(engine: LLMEngine, config: ServerConfig | None = None) -> FastAPI:
    server = Server(engine, config or ServerConfig())
    app = FastAPI(title="Charioteer", lifespan=server.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.model_name = server.model_name
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
    if server.config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server.config.api_key)
    app.state.server = server  # the app owns the server: the routes hold it weakly (`_weakly`)
    for path, endpoint, method in (
            ("/health", server.health, "GET"), ("/metrics", server.get_metrics, "GET"),
            ("/dashboard", server.dashboard_page, "GET"), ("/dashboard/events", server.dashboard_events, "GET"),
            ("/dashboard/records", server.dashboard_records, "GET"), ("/v1/models", server.list_models, "GET"),
            ("/v1/completions", server.completions, "POST"), ("/v1/chat/completions", server.chat_completions, "POST"),
            ("/tokenize", server.tokenize, "POST"), ("/detokenize", server.detokenize, "POST")):
        app.add_api_route(path, _weakly(endpoint), methods=[method])
    return app


def _weakly(endpoint):
    """An async endpoint, a bound method of a Server, as a function that holds its server through a weak reference.

    FastAPI (0.165) keeps every endpoint it has classified in a module-level cache of 4096 entries, so a bound
    method given to it kept its Server, and the Server its engine (weights, KV cache), alive after the app was
    gone: a process that built a few apps held gigabytes. The app owns the server instead (`app.state.server`).
    """
    method = weakref.WeakMethod(endpoint)

    async def call(*args, **kwargs):
        return await method()(*args, **kwargs)

    # FastAPI reads the parameters from the signature; not functools.wraps, whose __wrapped__ holds the method
    call.__signature__ = inspect.signature(endpoint)
    call.__name__ = call.__qualname__ = endpoint.__name__
    return call


class Server:
    """One app's state (config, engine thread, metrics) and its endpoints, a method each.

    The endpoints have no return annotations: FastAPI would take one for a response model.
    """

    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.model_name = config.model_name or engine.model_config.name
        self.names = {self.model_name, *config.aliases}
        self.metrics = ServerMetrics(self.model_name)
        self.dashboard = dashboard.DashboardHub()
        self.async_engine = AsyncEngine(engine, self.metrics, max_queue=config.max_queue, dashboard=self.dashboard)
        engine.subscribe(self.dashboard.observe_step)
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        loop = asyncio.get_running_loop()
        self.dashboard.start(loop)
        self.async_engine.start(loop)
        try:
            yield
        finally:
            self.async_engine.shutdown()
            self.dashboard.stop()

    # ---- endpoints ----------------------------------------------------------------------------

    async def health(self):
        if not self.async_engine.alive:
            return JSONResponse(protocol.error_body("the engine is not running", "server_error"), status_code=503)
        return {"status": "ok"}

    async def get_metrics(self):
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def dashboard_page(self):
        return HTMLResponse(dashboard.live_page(self.model_name))

    async def dashboard_events(self):
        """Server-sent events: a snapshot of the recent rows, then at most 10 updates a second."""
        return dashboard.DashboardStream(self.dashboard)

    async def dashboard_records(self, n: int = 500):
        """The last n rows the dashboard holds, its latency samples and its number of clients (JSON)."""
        if n < 0:
            raise protocol.bad_request("n must be >= 0", param="n")
        return self.dashboard.snapshot(n)

    async def list_models(self):
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "charioteer",
            "root": self.engine.args.model or self.model_name, "max_model_len": self.engine.max_model_len,
        }]}

    async def completions(self, request: Request):
        arrival = time.monotonic()
        req = await self.read_request(request, protocol.CompletionRequest)
        protocol.check_completion(req)
        prompts = protocol.completion_prompts(req)
        samples = len(prompts) * (req.best_of or req.n or 1)
        if samples > self.async_engine.max_outstanding:
            raise protocol.bad_request(f"a batch of {len(prompts)} prompts of {samples // len(prompts)} samples each "
                                       f"is more than this server holds at once "
                                       f"({self.async_engine.max_outstanding}); send fewer", param="prompt")
        echo_only = bool(req.echo) and req.max_tokens == 0  # returns the prompt; 1 token is still run, as vLLM does
        max_tokens = 16 if req.max_tokens is None else (1 if echo_only else req.max_tokens)  # 16: OpenAI's default
        params = protocol.sampling_params(req, max_tokens, req.logprobs)
        params.structured_outputs = await self.output_constraint(req)
        if req.echo and req.logprobs is not None:
            params.prompt_logprobs = req.logprobs
        request_id = f"cmpl-{uuid.uuid4().hex}"
        group = await self.submit_all(prompts, params, arrival, request_id, bool(req.echo))
        reply = replies.CompletionReply(request_id, self.model_name, len(group.streams), req.stream_options,
                                        req.logprobs, [s.prompt_text or "" for s in group.streams] if req.echo else None,
                                        echo_only, samples=params.num_samples, keep=params.n)
        return await _respond(request, bool(req.stream), group, reply)

    async def chat_completions(self, request: Request):
        arrival = time.monotonic()
        req = await self.read_request(request, protocol.ChatCompletionRequest)
        protocol.check_chat(req)
        messages = protocol.chat_messages(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = protocol.sampling_params(req, max_tokens, logprobs)
        params.structured_outputs = await self.output_constraint(req)
        streams = await self.submit(None, params, messages, max_tokens is None, arrival, "chatcmpl")
        reply = replies.ChatReply(streams[0].request_id, self.model_name, req.stream_options, bool(req.logprobs),
                                  num_choices=len(streams))
        return await _respond(request, bool(req.stream), StreamGroup(streams), reply)

    async def tokenize(self, request: Request):
        body = protocol.parse_json(await self.read_body(request))
        model_cls = protocol.TokenizeChatRequest if "messages" in body else protocol.TokenizeCompletionRequest
        req = self.check_model(protocol.validate_body(body, model_cls))
        if isinstance(req, protocol.TokenizeChatRequest):
            protocol.check_tokenize_chat(req)
            job = tokenization.chat_job(protocol.chat_messages(req), req.add_generation_prompt,
                                        req.add_special_tokens, bool(req.return_token_strs))
        else:
            job = tokenization.text_job(req.prompt, req.add_special_tokens, bool(req.return_token_strs))
        return await self.on_engine(job, "messages" if "messages" in body else "prompt")

    async def detokenize(self, request: Request):
        req = await self.read_request(request, protocol.DetokenizeRequest)
        return await self.on_engine(tokenization.detokenize_job(req.tokens), "tokens")

    # ---- request handling ---------------------------------------------------------------------

    async def read_request(self, request: Request, model_cls: type):
        """The parsed body, for the model this server serves (or none named)."""
        return self.check_model(protocol.parse_body(await self.read_body(request), model_cls))

    def check_model(self, req):
        if req.model is not None and req.model not in self.names:
            raise APIError(404, f"the model '{req.model}' does not exist: this server serves '{self.model_name}'",
                           "invalid_request_error", "model", "model_not_found")
        return req

    async def read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        too_big = APIError(413, f"request body is over the {limit}-byte limit", "invalid_request_error",
                           None, "request_too_large")
        length = request.headers.get("content-length")
        if length is not None:
            try:
                if int(length) > limit:
                    raise too_big
            except ValueError:
                raise protocol.bad_request("bad Content-Length header") from None
        chunks, size = [], 0
        async for chunk in request.stream():  # Content-Length may be absent or lie
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def output_constraint(self, req):
        """The request's StructuredOutputsParams, compiled off the engine thread; a 400 naming the
        field if it does not compile."""
        asked = protocol.structured_outputs(req)
        if asked is None:
            return None
        spec, param = asked
        self.check_alive()
        try:
            await self.async_engine.compile_grammar(spec)
        except ValueError as exc:
            raise protocol.bad_request(str(exc), param=param, code="invalid_constraint") from None
        return spec

    async def submit_all(self, prompts, params, arrival, request_id: str, echo: bool) -> StreamGroup:
        """One request per prompt, queued together; if any is refused, the others are released and
        the first refusal (in prompt order) is raised."""
        if len(prompts) == 1:
            return StreamGroup(await self.submit(prompts[0], params, None, False, arrival, request_id=request_id,
                                                 echo=echo))
        results = await asyncio.gather(*(
            self.submit(p, copy.deepcopy(params), None, False, arrival, request_id=f"{request_id}-{i}", echo=echo)
            for i, p in enumerate(prompts)), return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            for r in results:
                if not isinstance(r, BaseException):
                    for stream in r:
                        stream.close()
            i, exc = failed[0]
            if isinstance(exc, APIError) and exc.status == 400:
                raise protocol.bad_request(f"prompt {i}: {exc.message}", exc.param, exc.code) from None
            raise exc
        return StreamGroup([stream for streams in results for stream in streams])  # choice i * samples + j

    async def submit(self, prompt, params, messages, auto_max_tokens, arrival, prefix="cmpl", request_id=None,
                     echo=False) -> list[RequestStream]:
        self.check_alive()
        try:
            return await self.async_engine.submit(prompt, params, messages=messages, auto_max_tokens=auto_max_tokens,
                                                  arrival_time=arrival, prefix=prefix, request_id=request_id,
                                                  echo=echo)
        except QueueFull as exc:
            raise APIError(503, f"server overloaded: {exc}; retry later", "server_overloaded", None, "queue_full",
                           {"Retry-After": str(self.config.retry_after_s)}) from None
        except ValueError as exc:
            message = str(exc)
            param = "max_tokens" if "max_tokens" in message else ("messages" if messages is not None else "prompt")
            raise protocol.bad_request(message, param=param) from None

    async def on_engine(self, job, param: str):
        """job(engine) on the engine thread; its ValueError is a 400 naming `param`."""
        self.check_alive()
        try:
            return await self.async_engine.call(job)
        except ValueError as exc:
            raise protocol.bad_request(str(exc), param=param) from None

    def check_alive(self) -> None:
        if not self.async_engine.alive:
            raise APIError(503, "the engine is not running", "server_error", None, "engine_dead")


async def _respond(request: Request, streaming: bool, group: StreamGroup, reply: replies.Reply):
    if streaming:
        return SSEResponse(group, reply)
    return reply.answer(await _collect(request, group))


async def _collect(request: Request, group: StreamGroup) -> list[list[Delta]]:
    """All deltas of a non-streaming call, per choice; aborts its requests if the client goes away."""
    watcher = asyncio.create_task(_close_on_disconnect(request.receive, group))
    choices: list[list[Delta]] = [[] for _ in group.streams]
    try:
        while not group.finished:
            item = await group.next()
            if item is None:  # the client went away
                raise APIError(499, "client disconnected", "invalid_request_error", None, "client_closed")
            choices[item[0]].append(item[1])
        return choices
    except EngineError as exc:
        raise APIError(500, str(exc), "internal_error", None, "engine_error") from None
    finally:
        watcher.cancel()
        group.close()


async def _close_on_disconnect(receive, group: StreamGroup) -> None:
    """Closes the group, aborting its requests at once, when the client disconnects."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            group.close()
            return


# ---- errors, auth -----------------------------------------------------------------------------


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _on_api_error(request: Request, exc: APIError):
    return _error_response(exc)


async def _on_http_error(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(protocol.error_body(str(exc.detail), kind, None, None), status_code=exc.status_code,
                        headers=exc.headers)


async def _on_unexpected(request: Request, exc: Exception):  # pragma: no cover - a bug
    log.exception("unhandled error")
    return JSONResponse(protocol.error_body(f"internal error: {type(exc).__name__}", "internal_error"),
                        status_code=500)


GUARDED_PATHS = ("/v1", "/tokenize", "/detokenize")  # what the API key protects; probes and pages are open


class APIKeyMiddleware:
    """401 for API requests without `Authorization: Bearer <key>` (plain ASGI: keeps streaming intact)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PATHS):
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


# ---- streaming --------------------------------------------------------------------------------


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(Response):
    """Server-sent events for one API call: `data: {json}` chunks, then `data: [DONE]`.

    Nothing but the headers goes out before the first token (the reply holds chat's role chunk
    back until then). Watches the connection while streaming: a client that goes away aborts its
    requests at once (the engine frees their KV blocks before its next step), not at the next token.
    """

    def __init__(self, group: StreamGroup, reply: replies.Reply) -> None:
        # Not Response.__init__, which renders a whole body; FastAPI still reads `background`.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.group, self.reply = group, reply

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.create_task(_close_on_disconnect(receive, self.group))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if await self._send_deltas(send):
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        except OSError:  # the connection broke while sending
            pass
        finally:
            watcher.cancel()
            self.group.close()

    async def _send_deltas(self, send) -> bool:
        """Events for every delta, through the last choice's last; False if the client went away first."""
        while True:
            try:
                item = await self.group.next()
            except EngineError as exc:
                await self._event(send, protocol.error_body(str(exc), "internal_error", None, "engine_error"))
                return True
            if item is None:
                return False
            for obj in self.reply.chunks(*item):
                await self._event(send, obj)
            if self.group.finished:
                for obj in self.reply.final_chunks():
                    await self._event(send, obj)
                return True

    @staticmethod
    async def _event(send, obj: dict) -> None:
        await send({"type": "http.response.body", "body": _sse(obj), "more_body": True})
