"""Request state shared by the schedulers, the executors and the simulator.

A request's tokens are its prompt followed by its outputs. `num_computed_tokens` counts the
tokens whose KV entries are in the cache. What remains to compute is
`token_ids[num_computed_tokens:]`; a batch entry that reaches the end of that list yields the
next token. After preemption by recompute, `num_computed_tokens` drops to 0 and the prompt and
the outputs so far are prefilled again (in chunks, under SARATHI), then decoding resumes.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from charioteer.sampling_params import SamplingParams


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

    @property
    def num_remaining_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while prompt (or recompute) work is pending; False once it decodes one token a step."""
        return self.num_output_tokens == 0 or self.num_remaining_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_id_at(self, index: int) -> int:
        n = self.num_prompt_tokens
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, stop: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]

    def append_output_token(self, token_id: int, now: float | None = None) -> None:
        """Record a sampled token and decide, from token ids alone, whether the request is done.

        Stop strings need text, so the engine checks those itself and calls Scheduler.finish.
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
        elif self.num_output_tokens >= self.params.max_tokens:
            self.finish_reason = "length"
