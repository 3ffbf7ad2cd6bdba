"""The Batch plan: the one contract between schedulers and executors.

A batch is a flat list of tokens. For each request in it, an entry says which slice of the
request's tokens runs now: a prompt chunk (or a whole prompt) or one decode token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from charioteer.request import Request


@dataclass(frozen=True)
class BatchEntry:
    request: Request
    start: int  # index of the first token run now; tokens [0, start) are already in the KV cache
    num_tokens: int
    is_prefill: bool
    samples: bool  # whether its last position yields a new token (it reaches the request's last token)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def context_len(self) -> int:
        return self.end


@dataclass
class Batch:
    entries: list[BatchEntry] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # requests preempted while planning it

    def add(self, request: Request, num_tokens: int) -> BatchEntry:
        start = request.num_computed_tokens
        entry = BatchEntry(request, start, num_tokens, request.in_prefill, start + num_tokens == request.num_tokens)
        self.entries.append(entry)
        return entry

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    @property
    def prefills(self) -> list[BatchEntry]:
        return [e for e in self.entries if e.is_prefill]

    @property
    def decodes(self) -> list[BatchEntry]:
        return [e for e in self.entries if not e.is_prefill]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries if e.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for e in self.entries if not e.is_prefill)

    def describe(self) -> str:
        return f"Batch({len(self.prefills)} prefill/{self.num_prefill_tokens} tok, {self.num_decode_tokens} decodes)"
