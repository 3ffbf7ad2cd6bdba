"""The OpenAI-compatible API's response bodies: the whole answer, or the chunks of its stream.

A reply has one choice per sample of each prompt (a batched completion has several prompts;
`n` gives each several samples): choice i * n + j is prompt i's sample j. A stream sends nothing
for a choice before its first generated token: chat's role chunk and an echoed prompt go out
with it, so a client that times the first chunk times the first token (as vLLM does).
"""
from __future__ import annotations

import time

from charioteer.serving.async_engine import Delta, TokenLogprob
from charioteer.serving.protocol import StreamOptions


def usage(lasts: list[Delta | None], samples: int = 1) -> dict:
    """Token counts over the choices, from each one's latest delta; a prompt counts once however
    many samples (`samples` consecutive choices) it has."""
    prompt = sum(d.prompt_tokens for d in lasts[::samples] if d is not None)
    completion = sum(d.completion_tokens for d in lasts if d is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(logprobs: list[TokenLogprob], offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in logprobs:
        tokens.append(lp.token)
        token_lps.append(lp.logprob)
        tops.append(None if lp.top is None else {t: v for t, v in lp.top})
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict:
    return {"content": [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                          for t, v in lp.top or []]}
                        for lp in logprobs]}


def _logprobs_of(deltas: list[Delta]) -> list[TokenLogprob]:
    return [lp for d in deltas for lp in d.logprobs or []]


class Reply:
    """The response bodies of one API call: the whole answer, or the chunks of its stream."""

    object: str  # of the whole answer
    chunk_object: str
    usage_first = False  # whether `usage` precedes `choices` in a chunk (chat's order, kept as it was)

    def __init__(self, request_id: str, model: str, num_choices: int, stream_options: StreamOptions | None,
                 samples: int = 1, keep: int | None = None) -> None:
        """`samples`: streams per prompt (n, or best_of), consecutive; `keep`: choices per prompt in
        the answer (n), the samples of highest cumulative logprob when fewer than `samples`."""
        self.samples = samples
        self.keep = keep or samples
        self.id = request_id
        self.created = int(time.time())
        self.model = model
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.continuous_usage = self.include_usage and bool(stream_options.continuous_usage_stats)
        self.last: list[Delta | None] = [None] * num_choices  # each choice's latest streamed delta

    def choice(self, index: int, deltas: list[Delta]) -> dict:
        raise NotImplementedError

    def delta_choice(self, index: int, delta: Delta, first: bool) -> dict | None:
        """A stream chunk's choice for `delta`, or None if it adds nothing to show."""
        raise NotImplementedError

    def first_chunks(self, index: int, delta: Delta) -> list[dict]:
        """Chunks that go out just before a choice's first delta."""
        return []

    def answer(self, choices: list[list[Delta]]) -> dict:
        lasts = [deltas[-1] for deltas in choices]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self.choice(i, deltas) for i, deltas in enumerate(self._best(choices))],
                "usage": usage(lasts, self.samples)}

    def _best(self, choices: list[list[Delta]]) -> list[list[Delta]]:
        """best_of: each prompt's `keep` samples of highest cumulative logprob, in that order."""
        if self.keep == self.samples:
            return choices
        kept = []
        for first in range(0, len(choices), self.samples):
            group = choices[first:first + self.samples]
            kept += sorted(group, key=lambda deltas: -sum(lp.logprob for lp in _logprobs_of(deltas)))[:self.keep]
        return kept

    def chunks(self, index: int, delta: Delta) -> list[dict]:
        """The stream chunks for one delta of choice `index` (maybe none)."""
        first = self.last[index] is None
        self.last[index] = delta
        out = self.first_chunks(index, delta) if first else []
        choice = self.delta_choice(index, delta, first)
        if choice is not None:
            out.append(self._chunk([choice], usage([delta]) if self.continuous_usage else None))
        return out

    def final_chunks(self) -> list[dict]:
        """After every choice finished: the usage chunk, if asked for."""
        if not self.include_usage:
            return []
        return [self._chunk([], usage(self.last, self.samples))]

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model}
        if not self.include_usage:
            body["choices"] = choices
        elif self.usage_first:
            body.update(usage=usage, choices=choices)
        else:
            body.update(choices=choices, usage=usage)
        return body


class CompletionReply(Reply):
    object = chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, num_choices: int, stream_options: StreamOptions | None,
                 logprobs: int | None, echo: list[str] | None = None, echo_only: bool = False,
                 samples: int = 1, keep: int | None = None) -> None:
        """`echo`: each stream's prompt text, shown before its output; `echo_only`: the output is not
        shown (echo with max_tokens=0)."""
        super().__init__(request_id, model, num_choices, stream_options, samples, keep)
        self.logprobs = logprobs
        self.echo = echo
        self.echo_only = echo_only
        self.offsets = [0] * num_choices  # of each choice's next streamed text: its logprobs' text_offset

    def _shown(self, index: int, deltas: list[Delta], first: bool) -> tuple[str, list[TokenLogprob]]:
        """The text and token logprobs that `deltas` add to choice `index`, with the prompt if echoed."""
        text, logprobs = "".join(d.text for d in deltas), _logprobs_of(deltas)
        if self.echo_only:
            text, logprobs = "", []
        if self.echo is not None and first:
            text = self.echo[index // self.keep * self.samples] + text  # the choice's prompt
            logprobs = list(deltas[0].prompt_logprobs or []) + logprobs
        return text, logprobs

    def _choice(self, index: int, text: str, logprobs: list[TokenLogprob], offset: int, last: Delta) -> dict:
        return {"index": index, "text": text,
                "logprobs": None if self.logprobs is None else completion_logprobs(logprobs, offset),
                "finish_reason": last.finish_reason if last.finished else None}

    def choice(self, index: int, deltas: list[Delta]) -> dict:
        text, logprobs = self._shown(index, deltas, True)
        return self._choice(index, text, logprobs, 0, deltas[-1])

    def delta_choice(self, index: int, delta: Delta, first: bool) -> dict | None:
        text, logprobs = self._shown(index, [delta], first)
        if not (text or logprobs or delta.finished):
            return None
        choice = self._choice(index, text, logprobs, self.offsets[index], delta)
        self.offsets[index] += len(text)
        return choice


class ChatReply(Reply):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    usage_first = True

    def __init__(self, request_id: str, model: str, stream_options: StreamOptions | None, logprobs: bool,
                 num_choices: int = 1) -> None:
        """`num_choices`: the samples (n) of the one conversation."""
        super().__init__(request_id, model, num_choices, stream_options, samples=num_choices)
        self.logprobs = logprobs

    def choice(self, index: int, deltas: list[Delta]) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                "logprobs": chat_logprobs(_logprobs_of(deltas)) if self.logprobs else None,
                "finish_reason": deltas[-1].finish_reason}

    def first_chunks(self, index: int, delta: Delta) -> list[dict]:
        role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
        prompt_only = {"prompt_tokens": delta.prompt_tokens, "completion_tokens": 0,
                       "total_tokens": delta.prompt_tokens}
        return [self._chunk([role], prompt_only if self.continuous_usage else None)]

    def delta_choice(self, index: int, delta: Delta, first: bool) -> dict | None:
        if not (delta.text or delta.finished or delta.logprobs):
            return None
        return {"index": index, "delta": {"content": delta.text} if delta.text or not delta.finished else {},
                "logprobs": chat_logprobs(delta.logprobs or []) if self.logprobs else None,
                "finish_reason": delta.finish_reason if delta.finished else None}
