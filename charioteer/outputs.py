"""Results returned to users, shaped like vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}


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
    extra: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.outputs[0].text
