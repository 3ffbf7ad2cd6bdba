"""The Batch plan, the one contract between schedulers and executors, and what every scheduling
policy shares: queues, admission, preemption and the state update.

A batch is a flat list of tokens. For each request in it, an entry says which slice of the
request's tokens runs now: a prompt chunk (or a whole prompt) or one decode token. The real model,
the pipeline stages and the simulator's cost model all carry out this plan.

A policy only decides what goes in the next batch (`_schedule`). Updating request state when a
batch returns (`on_batch_done`) is the same for all of them, and so is preemption by recompute:
free the newest running request's blocks and put it back at the head of the queue.

Under `scheduling_policy="priority"` both queues are kept in `Request.priority_key` order (lower
priority first, then earlier arrival): the waiting queue orders admission, the running list's
last request is the first preemption victim, a request never preempts a better one to grow (it
yields itself), and a waiting request that outranks running ones may preempt them to be admitted
(not under reserved KV, which promises that a running request is never preempted).

Several batches may be in flight at once (pipeline micro-batches). A request inside a batch
that has not returned is skipped by the next plans, is never a preemption victim, and keeps its
KV blocks until that batch returns, even if it is aborted meanwhile.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from charioteer.config import SchedulerConfig
from charioteer.memory.block_manager import BlockManager, cdiv
from charioteer.request import Request, RequestStatus

# What a cost model needs of one entry: (num_tokens, start, is_prefill). A plain tuple: the
# simulator builds millions of them.
PlanRow = tuple[int, int, bool]


class PlanCounts:
    """What a plan's `entries` (each with num_tokens, start, is_prefill) add up to: shared by the
    Batch and by the engine's record of it."""

    entries: Sequence

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries if e.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for e in self.entries if not e.is_prefill)

    def plan(self) -> list[PlanRow]:
        return [(e.num_tokens, e.start, e.is_prefill) for e in self.entries]


class BatchEntry(NamedTuple):
    """Immutable (a grown entry is a new one). A NamedTuple rather than a frozen dataclass: the
    simulator builds millions, and a frozen dataclass's __init__ took 1.6 us to the tuple's 0.5."""

    request: Request
    start: int  # index of the first token run now; tokens [0, start) are already in the KV cache
    num_tokens: int
    is_prefill: bool
    samples: bool  # whether its last position yields a new token (it reaches the request's last token)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class Batch(PlanCounts):
    entries: list[BatchEntry] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # requests preempted while planning it
    # A decode-only plan may run several steps (num_scheduler_steps): each step's token feeds the next, and
    # on_batch_done follows each step in turn (next_step gives the plan of the steps after the first).
    num_steps: int = 1

    def add(self, request: Request, num_tokens: int) -> BatchEntry:
        start = request.num_computed_tokens
        entry = BatchEntry(request, start, num_tokens, request.in_prefill, start + num_tokens == request.num_tokens)
        self.entries.append(entry)
        return entry

    def grow(self, entry: BatchEntry, extra: int) -> BatchEntry:
        """Replace `entry` by one that runs `extra` more of its request's tokens (KV slots already ensured)."""
        request, num = entry.request, entry.num_tokens + extra
        grown = BatchEntry(request, entry.start, num, entry.is_prefill, entry.start + num == request.num_tokens)
        self.entries[self.entries.index(entry)] = grown
        return grown

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def prefills(self) -> list[BatchEntry]:
        return [e for e in self.entries if e.is_prefill]

    @property
    def decodes(self) -> list[BatchEntry]:
        return [e for e in self.entries if not e.is_prefill]


def _insert_by_priority(queue: deque[Request] | list[Request], request: Request) -> None:
    """Insert after every request of the same or a better priority_key (the queue is in that order)."""
    i = len(queue)
    while i > 0 and queue[i - 1].priority_key > request.priority_key:
        i -= 1
    queue.insert(i, request)


class Scheduler(ABC):
    name: str = ""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 holds_stop_string: Callable[[Request], bool] | None = None) -> None:
        """`holds_stop_string(request)`: whether its output text holds a stop string (needs a tokenizer)."""
        self.config = config
        self.blocks = block_manager
        self.holds_stop_string = holds_stop_string
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order (priority: priority_key order); victims last
        self.num_preemptions = 0
        self.by_priority = config.scheduling_policy == "priority"
        # Ready requests a capped plan hides from the policy (flagged in flight meanwhile): unlike
        # requests really in flight, they may be preempted to make room.
        self._hidden: set[int] = set()
        # n > 1: samples that wait for their sample 0 to prefill the prompt, by its request id.
        self._forks: dict[str, list[Request]] = {}

    # ---- queue management -------------------------------------------------------------

    def check_request(self, request: Request) -> None:
        """Raise ValueError if this scheduler cannot take `request` (before anything is queued)."""
        if request.priority != 0 and not self.by_priority:
            raise ValueError(f"request {request.request_id} has priority {request.priority} but the scheduling "
                             f"policy is {self.config.scheduling_policy}: start with --scheduling-policy priority "
                             f"(scheduling_policy='priority') or leave priority at 0")

    def add_request(self, request: Request) -> None:
        self.check_request(request)
        if not self.blocks.fits_ever(request):
            raise ValueError(
                f"request {request.request_id} needs {request.max_num_tokens} tokens of KV cache "
                f"(prompt {request.num_prompt_tokens} + max_tokens {request.params.max_tokens}) but the "
                f"whole cache holds {self.blocks.capacity_tokens}: shorten the prompt, lower max_tokens "
                f"or give the KV cache more memory"
            )
        request.status = RequestStatus.WAITING
        leader = request.fork_of
        if leader is not None and not leader.is_finished and not leader.output_token_ids:
            self._forks.setdefault(leader.request_id, []).append(request)
            return
        self._enqueue(request, front=False)

    def _release_forks(self, leader: Request) -> None:
        """`leader` has prefilled its prompt (or ended): the samples waiting for it are queued
        first, as they arrived with it; the block manager starts them on its blocks."""
        for request in reversed(self._forks.pop(leader.request_id, [])):
            self._enqueue(request, front=True)

    def _enqueue(self, request: Request, front: bool) -> None:
        """Into the waiting queue: at its tail (new) or head (preempted), or by priority."""
        if not self.by_priority:
            if front:
                self.waiting.appendleft(request)
            else:
                self.waiting.append(request)
            return
        _insert_by_priority(self.waiting, request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._forks)

    @property
    def token_budget(self) -> int | None:
        """Tokens the policy plans a batch with (SARATHI's chunk size), None where it has no budget."""
        return self.config.max_num_batched_tokens

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running) + sum(map(len, self._forks.values()))

    def finish(self, request: Request, reason: str) -> None:
        """End a request (stop, length or abort) and free its KV blocks at once."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request.fork_of is not None and request in self._forks.get(request.fork_of.request_id, ()):
            held = self._forks[request.fork_of.request_id]
            held.remove(request)
            if not held:
                del self._forks[request.fork_of.request_id]
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self._release_forks(request)
        if not request.in_flight:  # else on_batch_done frees them, once no stage can write them
            self.blocks.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.monotonic()

    def abort(self, request_id: str) -> Request | None:
        for request in [*self.running, *self.waiting, *(r for held in self._forks.values() for r in held)]:
            if request.request_id == request_id:
                self.finish(request, "abort")
                return request
        return None

    # ---- building blocks for policies -------------------------------------------------

    def _can_admit(self, request: Request, first_tokens: int) -> bool:
        return len(self.running) < self.config.max_num_seqs and self.blocks.can_admit(request, first_tokens)

    def _admit(self, request: Request, first_tokens: int) -> int:
        """Move a waiting request (normally the head) to running if memory allows its first batch.

        Returns the tokens its first batch runs (0: not admitted): `first_tokens`, or fewer when
        the prefix cache already holds the start of its prompt.
        """
        if not self._can_admit(request, first_tokens):
            return 0
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:
            self.waiting.remove(request)
        request.num_computed_tokens = self.blocks.admit(request, first_tokens)
        first_tokens = min(first_tokens, request.num_remaining_tokens)
        if not self.blocks.ensure(request, request.num_computed_tokens + first_tokens):
            raise AssertionError("admission checked the blocks it needs")
        request.status = RequestStatus.RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        if self.by_priority:
            _insert_by_priority(self.running, request)
        else:
            self.running.append(request)
        return first_tokens

    def _preempt(self, request: Request, batch: Batch) -> None:
        self.running.remove(request)
        self.blocks.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)
        batch.preempted.append(request)

    def _first_tokens(self, request: Request) -> int:
        """Tokens a waiting request's first batch would take (whole prompts; SARATHI: one chunk)."""
        return request.num_remaining_tokens

    def _preempt_for_priority(self, batch: Batch) -> None:
        """Priority policy: while the best waiting request cannot be admitted (batch cap or memory),
        preempt running requests of strictly lower priority, the lowest (latest) first."""
        while self.waiting:
            head = self.waiting[0]
            first = self._first_tokens(head)
            victims = [r for r in self.running if not r.in_flight and r.priority > head.priority]
            if not victims or self._can_admit(head, first) or not self._fits_without(head, first, victims):
                return
            self._preempt(victims[-1], batch)

    def _fits_without(self, request: Request, first_tokens: int, others: list[Request]) -> bool:
        """Whether `request` could be admitted once `others` are preempted."""
        blocks = self.blocks  # paged KV: the first batch's blocks
        freed = sum(len(blocks.block_table(r)) for r in others)
        return (len(self.running) - len(others) < self.config.max_num_seqs
                and cdiv(first_tokens, blocks.block_size) <= blocks.num_free_blocks + freed)

    def _grow_or_preempt(self, request: Request, num_tokens: int, batch: Batch) -> bool:
        """Make room for `num_tokens` more tokens of `request`, preempting the newest others.

        Requests already placed in `batch` or in flight are never preempted. Returns False if
        `request` cannot grow now: it was preempted (now or earlier in this plan), or it waits
        for in-flight batches.
        """
        if request.status is not RequestStatus.RUNNING:
            return False
        in_batch = None
        while not self.blocks.ensure(request, request.num_computed_tokens + num_tokens):
            if in_batch is None:  # built only when memory runs out: this is the hot path
                in_batch = {id(e.request) for e in batch.entries}
            victims = [r for r in self.running if id(r) not in in_batch and r is not request
                       and (not r.in_flight or id(r) in self._hidden)]
            if victims and self.by_priority and victims[-1].priority_key < request.priority_key:
                self._preempt(request, batch)  # every candidate outranks it: it yields
                return False
            if not victims:
                if any(r.in_flight and id(r) not in self._hidden for r in self.running if r is not request):
                    return False  # wait for in-flight batches to return instead of thrashing
                self._preempt(request, batch)
                return False
            self._preempt(victims[-1], batch)
        return True

    def _ready(self) -> list[Request]:
        """Running requests not inside an in-flight batch."""
        return [r for r in self.running if not r.in_flight]

    def _running_decodes(self) -> list[Request]:
        return [r for r in self.running if not r.in_flight and not r.in_prefill]

    def _running_prefills(self) -> list[Request]:
        return [r for r in self.running if not r.in_flight and r.in_prefill]

    # ---- the contract -----------------------------------------------------------------

    @abstractmethod
    def _schedule(self) -> Batch:
        """The policy: plan the next batch from the current state, reserving its KV slots."""

    def schedule(self, max_requests: int | None = None) -> Batch:
        """Plan the next batch; its requests stay in flight until on_batch_done.

        `max_requests` caps one micro-batch (the paper's per-micro-batch batch size under
        pipeline parallelism): the policy sees only that many ready running requests, oldest
        first, and only as many waiting ones as there is room left.
        """
        preempted = Batch()
        if self.by_priority and self.blocks.policy != "reserve":  # reserved KV promises no preemption
            self._preempt_for_priority(preempted)
        if max_requests is None:
            batch = self._schedule()
        else:
            batch = self._schedule_capped(max_requests)
        batch.preempted[:0] = preempted.preempted
        for entry in batch.entries:
            entry.request.in_flight = True
        if max_requests is None and self.config.num_scheduler_steps > 1:
            batch.num_steps = self._decode_steps(batch)
        return batch

    def _decode_steps(self, batch: Batch) -> int:
        """How many steps a plan runs: up to num_scheduler_steps for decodes alone with nothing else to plan
        (no request waits, none was preempted), where no request needs the engine between its tokens (logprobs,
        a grammar) and each has that many tokens left to generate; their KV slots are taken now. Else 1."""
        steps = self.config.num_scheduler_steps
        if self.waiting or self._forks or batch.preempted or not batch:
            return 1
        for entry in batch.entries:
            r = entry.request
            if entry.is_prefill or r.grammar is not None or r.params.logprobs is not None:
                return 1
            steps = min(steps, r.params.max_tokens - r.num_output_tokens)
        if steps < 2 or not self.blocks.ensure_all([(e.request, e.end + steps - 1) for e in batch.entries]):
            return 1
        return steps

    def next_step(self, batch: Batch) -> Batch:
        """The plan's next step, after on_batch_done of `batch` (its previous one): one decode token for each of
        its requests that did not finish, in flight again."""
        step = Batch(num_steps=batch.num_steps)
        for entry in batch.entries:
            request = entry.request
            if not request.is_finished:
                step.entries.append(BatchEntry(request, request.num_computed_tokens, 1, False, True))
                request.in_flight = True
        return step

    def _schedule_capped(self, max_requests: int) -> Batch:
        ready = self._ready()
        hidden = ready[max_requests:]
        room = max(0, max_requests - len(ready))
        held = [self.waiting.pop() for _ in range(max(0, len(self.waiting) - room))][::-1]
        for r in hidden:
            r.in_flight = True
        self._hidden = {id(r) for r in hidden}
        try:
            return self._schedule()
        finally:
            for r in hidden:
                r.in_flight = False
            self._hidden = set()
            if self.by_priority:  # requests preempted meanwhile may belong after some held ones
                for r in held:
                    _insert_by_priority(self.waiting, r)
            else:
                self.waiting.extend(held)

    def release(self, batches: list[Batch]) -> None:
        """Batches that will never return (their executor failed): their requests leave flight."""
        for batch in batches:
            for entry in batch.entries:
                entry.request.in_flight = False

    def on_batch_done(self, batch: Batch, sampled: Mapping[str, int]) -> list[Request]:
        """Advance every request in `batch`; `sampled` maps request_id to its new token.

        Returns the requests that finished (by stop token or length) with this batch.
        """
        now = time.monotonic()
        finished = []
        caching = self.blocks.prefix_cache is not None
        for entry in batch.entries:
            request = entry.request
            request.in_flight = False
            if request.is_finished:  # aborted while the batch ran
                self.blocks.free(request)
                continue
            request.num_computed_tokens = entry.end
            if caching:
                self.blocks.cache_computed(request)
            if entry.samples:
                request.append_output_token(sampled[request.request_id], now, self.holds_stop_string)
                if self._forks:  # n > 1 samples wait for this one's first token (the simulator never has any)
                    self._release_forks(request)
                if request.finish_reason is not None:
                    self.finish(request, request.finish_reason)
                    finished.append(request)
        return finished
