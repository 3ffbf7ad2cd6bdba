"""Run an LLMEngine in its own thread and serve its outputs to asyncio.

The engine is not thread-safe, so every call into it (tokenizing, make_request, add, step,
abort) happens on the engine thread. The event loop talks to it through a command deque
(`add`, `abort` and `call`), and the engine thread answers through `loop.call_soon_threadsafe`
onto one asyncio.Queue per request (or one future per call). The event loop never waits on
the engine.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from charioteer.engine.llm_engine import LLMEngine
from charioteer.engine.tbt import TimeBetweenTokens
from charioteer.request import Request, RequestOutput, SamplingParams, StructuredOutputsParams
from charioteer.serving.dashboard import DashboardHub
from charioteer.serving.metrics import ServerMetrics

log = logging.getLogger("charioteer.serving")
T = TypeVar("T")


class QueueFull(Exception):
    pass


class EngineError(Exception):
    """The engine failed while running a request (answered as HTTP 500)."""


@dataclass
class TokenLogprob:
    token: str
    logprob: float | None  # None for a prompt's first token: nothing predicts it
    top: list[tuple[str, float]] | None


@dataclass
class Delta:
    """What a request gained in one engine step."""
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    prompt_logprobs: list[TokenLogprob] | None = None  # on a request's first delta, when asked for


@dataclass
class Accepted:
    """The engine's answer to an `add` it accepted."""
    prompt_token_ids: list[int]
    prompt_text: str | None  # the prompt as text (token-id prompts decoded), when echo asked for it


_CLOSED = object()  # wakes a consumer whose request was closed from outside (disconnect)


@dataclass
class RequestStream:
    """The asyncio side of one request."""
    request_id: str
    engine: "AsyncEngine"
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_tokens: int = 0
    prompt_text: str | None = None  # set when submitted with echo=True
    finished: bool = False
    closed: bool = False

    async def next(self) -> Delta | None:
        """The next delta, or None once the request was closed from outside."""
        item = await self.queue.get()
        if item is _CLOSED:
            return None
        if isinstance(item, BaseException):
            self.finished = True
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        """Release the request: aborts it in the engine (freeing its KV blocks) if unfinished."""
        if self.closed:
            return
        self.closed = True
        self.engine._release(self)
        self.queue.put_nowait(_CLOSED)


@dataclass
class _Submission:
    streams: list[RequestStream]  # one per sample (n > 1: sample i's stream is the engine's `{i}_{id}`)
    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    auto_max_tokens: bool
    arrival_time: float
    echo: bool = False


@dataclass
class _Live:
    """Engine-thread state of one request."""
    request: Request
    stream: RequestStream
    sent_tokens: int = 0


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_queue: int = 256,
                 dashboard: DashboardHub | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.dashboard = dashboard  # gets each finished request's TTFT and times between tokens
        self.max_outstanding = engine.args.max_num_seqs + max_queue
        self.num_outstanding = 0  # event loop only
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        self.error: BaseException | None = None  # set if the engine thread itself died
        # Grammars compile here, off the engine thread (which then finds them in the engine's cache).
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="charioteer-grammar")
        self._tbt = TimeBetweenTokens()  # engine thread only
        if engine.scheduler.token_budget is not None:
            metrics.token_budget.set(engine.scheduler.token_budget)
        engine.subscribe(self._observe_step)

    # ---- lifecycle (event loop) -----------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="charioteer-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- requests (event loop) --------------------------------------------------------------

    async def submit(self, prompt: str | list[int] | None, params: SamplingParams, *,
                     messages: list[dict] | None = None, auto_max_tokens: bool = False,
                     arrival_time: float | None = None, prefix: str = "cmpl", request_id: str | None = None,
                     echo: bool = False) -> list[RequestStream]:
        """Queue a request; returns one stream per sample (`params.num_samples`) once the engine
        accepted it (raises ValueError if it refused).

        Raises QueueFull at once if too many requests are outstanding. `echo`: also give the
        prompt as text (`stream.prompt_text`).
        """
        count = params.num_samples
        if self.num_outstanding + count > self.max_outstanding:
            self.metrics.rejected.inc()
            raise QueueFull(f"{self.num_outstanding} requests outstanding and this one has {count}, the limit is "
                            f"{self.max_outstanding}")
        request_id = request_id or f"{prefix}-{uuid.uuid4().hex}"
        streams = [RequestStream(request_id if i == 0 else f"{i}_{request_id}", self) for i in range(count)]
        self.num_outstanding += count
        self._send(("add", _Submission(streams, prompt, messages, params, auto_max_tokens,
                                       arrival_time if arrival_time is not None else time.monotonic(), echo)))
        try:
            items = [await stream.queue.get() for stream in streams]
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        for stream, item in zip(streams, items):
            if isinstance(item, BaseException):
                for other in streams:
                    other.finished = True
                    other.close()
                raise item
            stream.prompt_tokens = len(item.prompt_token_ids)
            stream.prompt_text = item.prompt_text
        return streams

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile an output constraint on a worker thread into the engine's grammar cache; raises
        ValueError naming the problem if it does not compile."""
        await self._loop.run_in_executor(self._grammar_pool, self.engine.structured_outputs.compile, spec)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """fn(engine) run on the engine thread, between steps; its exception is raised here."""
        future = self._loop.create_future()
        self._send(("call", (fn, future)))
        return await future

    def _release(self, stream: RequestStream) -> None:
        self.num_outstanding -= 1
        if not stream.finished:
            self._send(("abort", stream.request_id))

    def _send(self, command) -> None:
        self._commands.append(command)
        self._wake.set()

    # ---- engine thread ------------------------------------------------------------------------

    def _deliver(self, stream: RequestStream, item) -> None:
        try:
            self._loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._drain()
                if not self.engine.has_unfinished_requests():
                    self._update_gauges()
                    self._wake.wait(0.5)
                    continue
                self._step()
        except BaseException as exc:  # pragma: no cover - a bug; /health reports it
            log.exception("engine thread died")
            self.error = exc
            died = EngineError(f"engine thread died: {exc}")
            for live in list(self._live.values()):
                self._deliver(live.stream, died)
            self._live.clear()
            self._fail_commands(died)

    def _fail_commands(self, error: EngineError) -> None:
        """Answer the adds and calls that will never be drained, so nobody waits on them."""
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":
                for stream in payload.streams:
                    self._deliver(stream, error)
            elif kind == "call":
                self._settle(payload[1], error, True)

    def _drain(self) -> None:
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":
                self._add(payload)
            elif kind == "call":
                self._call(*payload)
            else:
                live = self._live.pop(payload, None)
                if live is not None:
                    self.engine.abort(payload)
                    self.metrics.aborted.inc()

    def _call(self, fn, future: asyncio.Future) -> None:
        try:
            outcome, failed = fn(self.engine), False
        except Exception as exc:
            outcome, failed = exc, True
        self._settle(future, outcome, failed)

    def _settle(self, future: asyncio.Future, outcome, failed: bool) -> None:
        def settle() -> None:
            if not future.done():  # the caller may have gone away
                (future.set_exception if failed else future.set_result)(outcome)

        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def _add(self, sub: _Submission) -> None:
        engine = self.engine
        stream = sub.streams[0]
        added: list[Request] = []  # samples queued before a failure, taken back
        try:
            if sub.messages is not None:
                text = chat_prompt(engine, sub.messages)
                ids = engine.tokenizer.encode(text, add_special_tokens=False)
                if not ids:
                    raise ValueError("messages are empty after applying the chat template")
            else:
                text = sub.prompt if isinstance(sub.prompt, str) else None
                ids = engine.encode(sub.prompt)
            echoed = None
            if sub.echo:
                echoed = text if text is not None else prompt_text(engine, ids)
            if sub.auto_max_tokens:
                sub.params.max_tokens = max(1, engine.max_model_len - len(ids))
            request = engine.make_request(ids, sub.params, request_id=stream.request_id, prompt_text=text,
                                          arrival_time=sub.arrival_time)
            samples = engine.make_samples(request)
            for sample in samples:
                engine.add(sample, stream=True)
                added.append(sample)
        except Exception as exc:
            for sample in added:
                engine.abort(sample.request_id)
            if not isinstance(exc, ValueError):  # e.g. a chat template that raises something else
                log.exception("request %s could not be added", stream.request_id)
                exc = ValueError(f"could not build the prompt: {exc}")
            for one in sub.streams:
                self._deliver(one, exc)
            return
        for sample, one in zip(samples, sub.streams):
            self._live[one.request_id] = _Live(sample, one)
            self._deliver(one, Accepted(ids, echoed))
        self.metrics.prompt_tokens.inc(len(ids))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # Fail every live request rather than die: the server keeps serving new ones.
            log.exception("engine step failed; aborting %d requests", len(self._live))
            for request_id, live in list(self._live.items()):
                try:
                    self.engine.abort(request_id)
                except Exception:  # pragma: no cover
                    log.exception("abort of %s failed", request_id)
                self._deliver(live.stream, EngineError(f"the engine failed: {type(exc).__name__}: {exc}"))
            self._live.clear()
            return
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            delta = self._delta(live, out)
            if out.finished:
                del self._live[out.request_id]
                self._observe_finished(live.request, out)
            self._deliver(live.stream, delta)

    def _delta(self, live: _Live, out: RequestOutput) -> Delta:
        completion = out.outputs[0]
        new_ids = completion.token_ids[live.sent_tokens:]
        logprobs = None
        if completion.logprobs is not None:
            k = live.request.params.logprobs or 0
            logprobs = [self._token_logprob(tok, lp, k)
                        for tok, lp in zip(new_ids, completion.logprobs[live.sent_tokens:])]
        prompt_logprobs = None
        if live.sent_tokens == 0 and out.prompt_logprobs is not None:
            owner = live.request.fork_of or live.request  # sample 0 holds the prompt logprobs' k
            prompt_logprobs = self._prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                    owner.params.prompt_logprobs or 0)
        live.sent_tokens = len(completion.token_ids)
        self.metrics.generation_tokens.inc(len(new_ids))
        return Delta(out.new_text, new_ids, logprobs, out.finished, completion.finish_reason,
                     len(out.prompt_token_ids), len(completion.token_ids), prompt_logprobs)

    def _token_str(self, token: int) -> str:
        return self.engine.tokenizer.decode([token]) if self.engine.tokenizer else str(token)

    def _token_logprob(self, token: int, logprobs: dict[int, float], k: int) -> TokenLogprob:
        top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:k]
        return TokenLogprob(self._token_str(token), float(logprobs[token]),
                            [(self._token_str(t), float(v)) for t, v in top])

    def _prompt_logprobs(self, ids: list[int], logprobs: list[dict[int, float] | None], k: int) -> list[TokenLogprob]:
        """One entry per prompt token; the first (and any the executor did not give) has no logprob."""
        out = []
        for pos, token in enumerate(ids):
            known = logprobs[pos] if pos < len(logprobs) else None
            out.append(TokenLogprob(self._token_str(token), None, None) if known is None
                       else self._token_logprob(token, known, k))
        return out

    def _observe_finished(self, request: Request, out: RequestOutput) -> None:
        m = self.metrics
        m.success(out.outputs[0].finish_reason or "unknown")
        if request.scheduled_time is not None:
            m.queue_time.observe(max(0.0, request.scheduled_time - request.arrival_time))
        ttft = None
        if request.first_token_time is not None:
            ttft = max(0.0, request.first_token_time - request.arrival_time)
            m.ttft.observe(ttft)
        times = request.token_times
        gaps = [b - a for a, b in zip(times, times[1:])]
        for gap in gaps:
            m.itl.observe(gap)
        if self.dashboard is not None:
            self.dashboard.observe_request(ttft, gaps)
        end = request.finish_time or time.monotonic()
        m.e2e.observe(max(0.0, end - request.arrival_time))

    def _observe_step(self, step) -> None:
        """Step observer (engine thread): per-iteration metrics from the engine's step record."""
        self.num_steps += 1
        m = self.metrics
        m.iteration_tokens.observe(step.num_tokens)
        m.iteration_prefill_tokens.observe(step.num_prefill_tokens)
        m.iteration_decode_tokens.observe(step.num_decode_tokens)
        m.iteration_duration[step.kind].observe(step.duration_s)
        if step.preempted:
            m.preemptions.inc(len(step.preempted))
        if step.prefix_cache_queries:
            m.prefix_cache_queries.inc(step.prefix_cache_queries)
            m.prefix_cache_hits.inc(step.prefix_cache_hits)
        m.running.set(step.num_running)
        m.waiting.set(step.num_waiting)
        m.kv_usage.set(step.kv_blocks_used / step.kv_blocks_total)
        if step.token_budget is not None:
            m.token_budget.set(step.token_budget)
        if self._tbt.observe(step):
            m.tbt_p99.set(self._tbt.p99())

    def _update_gauges(self) -> None:
        """Between steps (an add or abort changed the queues): the gauges from the engine's state."""
        scheduler = self.engine.scheduler
        m = self.metrics
        m.running.set(len(scheduler.running))
        m.waiting.set(len(scheduler.waiting))
        m.kv_usage.set(self.engine.blocks.usage)


# ---- prompts (engine thread) ------------------------------------------------------------------


def chat_prompt(engine: LLMEngine, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The chat template applied to `messages` (ValueError if the model has no template)."""
    if engine.tokenizer is None:
        raise ValueError("this model has no tokenizer, so it has no chat template")
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)


def prompt_text(engine: LLMEngine, ids: list[int]) -> str:
    """Token ids as text, special tokens included (what echo shows of a token-id prompt)."""
    if engine.tokenizer is None:
        return ""
    return engine.tokenizer.decode(ids, skip_special_tokens=False)
