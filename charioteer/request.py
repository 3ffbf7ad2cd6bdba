"""A request: what it asks (SamplingParams, shaped like vLLM's), its state (Request, shared by the
schedulers, the executors and the simulator) and what it returns (RequestOutput).

A request's tokens are its prompt followed by its outputs. `num_computed_tokens` counts the
tokens whose KV entries are in the cache. What remains to compute is
`token_ids[num_computed_tokens:]`; a batch entry that reaches the end of that list yields the
next token. After preemption by recompute, `num_computed_tokens` drops to 0 and the prompt and
the outputs so far are prefilled again (in chunks, under SARATHI), then decoding resumes.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
GREEDY_BELOW = 1e-5  # temperatures this small are greedy: dividing by them overflows the logits


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's shape): exactly one of a JSON schema, a regex, a list of
    choices, an EBNF grammar or any JSON object. The engine compiles it with xgrammar."""
    json: dict | str | None = None  # a JSON schema, as an object or its text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's GBNF dialect)
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False  # compact JSON: no whitespace between its tokens

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(self.KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.json_object not in (None, True):
            raise ValueError("structured_outputs.json_object must be true when given")

    def key(self) -> str:
        """The constraint as canonical text: equal constraints compile to the same grammar."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True, ensure_ascii=False)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token
    # Lower runs first under scheduling_policy="priority". vLLM takes it beside the parameters
    # (generate(..., priority=)); those keywords set it here, so it travels with the request.
    priority: int = 0
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (vLLM's name)
    # Samples per prompt (vLLM's): `best_of` are generated (default n), the n of highest cumulative
    # logprob are returned. They share the prompt's KV blocks; sample i samples with seed + i.
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer from 0 to {MAX_LOGPROBS}, got {value!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer (lower runs first), got {self.priority!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (isinstance(self.best_of, bool) or not isinstance(self.best_of, int)
                                         or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def num_samples(self) -> int:
        """Samples generated per prompt: best_of, else n."""
        return self.best_of or self.n

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters sample `index` of a request runs with: one sample each, seed + index (as
        vLLM's), the sampled tokens' logprobs kept when best_of must rank the samples, and prompt
        logprobs only on sample 0 (the prompt is the same)."""
        return dataclasses.replace(
            self, n=1, best_of=None, seed=None if self.seed is None else (self.seed + index) % 2**63,
            logprobs=0 if self.logprobs is None and self.num_samples > self.n else self.logprobs,
            prompt_logprobs=self.prompt_logprobs if index == 0 else None)


class GrammarState(Protocol):
    """A request's place in its output grammar (the engine's xgrammar matcher)."""

    def is_terminated(self) -> bool: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None = None
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    num_preemptions: int = 0
    in_flight: bool = False  # inside a batch that has not returned yet (pipeline micro-batches)
    # Structured outputs: the sampler masks this request's logits with it and advances it with
    # each sampled token (before append_output_token sees the token).
    grammar: GrammarState | None = None
    # n > 1: the request's sample 0, which prefills the prompt; this sample waits for it and then
    # starts on its KV blocks (the scheduler and the block manager share them).
    fork_of: Request | None = None

    # Filled by the executor when asked for.
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)

    # Timestamps for latency metrics (monotonic seconds).
    scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt is empty: give at least one token or a non-empty string")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Length the request can reach: prompt plus every token it may generate."""
        return self.num_prompt_tokens + self.params.max_tokens

    # The schedulers (and the simulator through them) read these two millions of times: plain
    # len() arithmetic, without nested property calls.
    @property
    def num_remaining_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while prompt (or recompute) work is pending; False once it decodes one token a step."""
        n = len(self.output_token_ids)
        return n == 0 or len(self.prompt_token_ids) + n - self.num_computed_tokens > 1

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def priority_key(self) -> tuple[int, float]:
        """Order under priority scheduling: lower priority first, then earlier arrival."""
        return self.params.priority, self.arrival_time

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_id_at(self, index: int) -> int:
        n = self.num_prompt_tokens
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, stop: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]

    def append_output_token(self, token_id: int, now: float | None = None,
                            holds_stop_string: Callable[["Request"], bool] | None = None) -> None:
        """Record a sampled token and decide whether the request is done: the one place that does.

        A stop token, a completed grammar or a length limit ends it; else `holds_stop_string` (the
        engine's detokenizer: stop strings need text) may end it with "stop".
        """
        now = time.monotonic() if now is None else now
        self.output_token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
        if not self.params.ignore_eos and (
            token_id == self.eos_token_id or token_id in self.params.stop_token_ids
        ):
            self.finish_reason = "stop"
        elif self.grammar is not None and self.grammar.is_terminated():
            self.finish_reason = "stop"  # the grammar ended (with ignore_eos, its stop token is kept)
        elif self.num_output_tokens >= self.params.max_tokens:
            self.finish_reason = "length"
        elif self.params.stop and holds_stop_string is not None and holds_stop_string(self):
            self.finish_reason = "stop"


# ---- what a request returns (vLLM's RequestOutput / CompletionOutput) -------------------------


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}
    cumulative_logprob: float | None = None  # of the generated tokens, where their logprobs were computed


@dataclass
class RequestMetrics:
    arrival_time: float
    scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None  # first entry is None
    metrics: RequestMetrics | None = None
    new_text: str = ""  # text added since the previous output for this request (streaming)

    @property
    def text(self) -> str:
        return self.outputs[0].text


def merge_samples(outputs: list[RequestOutput], n: int, keep_logprobs: bool = True) -> RequestOutput:
    """One output for the samples of a request (sample 0's output first): all of them, or the n
    of highest cumulative logprob when best_of generated more, indexed 0..n-1. `keep_logprobs`
    False drops the per-token logprobs that best_of needed but the caller did not ask for."""
    completions = [o.outputs[0] for o in outputs]
    if len(completions) > n:
        completions = sorted(completions, key=lambda c: -c.cumulative_logprob)[:n]
    merged = [dataclasses.replace(c, index=i, logprobs=c.logprobs if keep_logprobs else None,
                                  cumulative_logprob=c.cumulative_logprob if keep_logprobs else None)
              for i, c in enumerate(completions)]
    return dataclasses.replace(outputs[0], outputs=merged, finished=all(o.finished for o in outputs))
