"""The per-iteration step record: what one `LLMEngine.step()` ran, and what it cost.

Everything outside the engine (server metrics, benchmarks, the simulator's validation, the
pipeline's bubble accounting, a live view) learns what happened from these records. An observer
is any callable taking a StepRecord, registered with `LLMEngine.subscribe`; it must not change
engine or request state. Records are immutable and hold request ids, not requests, so they can be
kept, sent to another thread or written as JSON (`to_dict`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from charioteer.scheduling.base import Batch, PlanCounts


@dataclass(frozen=True)
class EntryRecord:
    """One request's share of the batch: a prompt chunk (or recompute) or one decode token."""
    request_id: str
    start: int  # first position run now; positions [0, start) were already in the KV cache
    num_tokens: int
    is_prefill: bool
    samples: bool  # the entry yielded a new token


@dataclass(frozen=True)
class StageTiming:
    """One pipeline stage's times for a micro-batch (time.time() of the stage's machine)."""
    wait_begin: float  # the stage finished its previous work and began waiting for this one
    start: float  # its inputs were in; compute began
    end: float  # compute done, output handed to the link


@dataclass(frozen=True)
class PipelineTiming:
    dispatch: float  # the driver sent the plan (time.time())
    returned: float  # the driver received the logits
    stages: tuple[StageTiming, ...]


@dataclass(frozen=True)
class StepRecord(PlanCounts):
    index: int  # 0, 1, 2, ... over the engine's life
    entries: tuple[EntryRecord, ...]
    preempted: tuple[str, ...]  # requests preempted (by recompute) while this batch was planned
    finished: tuple[str, ...]  # requests that ended with this batch (stop, length or stop string)
    start_time: float  # time.monotonic() when the engine began this step
    schedule_s: float  # planning the batch
    execute_s: float  # forward pass and sampling (with a pipeline: waiting for the oldest micro-batch)
    duration_s: float  # the whole step, planning to state update
    cpu_s: float  # CPU time of the engine's thread over the whole step
    kv_blocks_used: int  # after the state update
    kv_blocks_total: int
    num_running: int
    num_waiting: int
    token_budget: int | None  # the chunk size C the policy planned with (SARATHI), else None
    pipeline: PipelineTiming | None = None  # with pipeline stages: the micro-batch's stage times
    # Steps of the plan this one belongs to (num_scheduler_steps): 1 for a plan of its own. A multi-step
    # plan's records tile the time of the step() call that ran it, each with an equal share of its planning
    # and bookkeeping; its tokens reach the caller together, when the call returns.
    plan_steps: int = 1
    plan_step: int = 0  # this record's place in its plan, 0 to plan_steps - 1
    # Prefix caching: prompt tokens looked up by the admissions of this step, and those found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def request_ids(self) -> list[str]:
        return [e.request_id for e in self.entries]

    @property
    def kind(self) -> str:
        """'prefill' (prompt work only), 'decode' (decodes only) or 'mixed'."""
        prefill = any(e.is_prefill for e in self.entries)
        decode = any(not e.is_prefill for e in self.entries)
        return "mixed" if prefill and decode else "prefill" if prefill else "decode"

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used

    def to_dict(self) -> dict:
        return {**asdict(self), "kind": self.kind, "num_prefill_tokens": self.num_prefill_tokens,
                "num_decode_tokens": self.num_decode_tokens}


StepObserver = Callable[[StepRecord], None]


def stream_times(records: list[StepRecord]) -> list[float]:
    """When each record's tokens reached their streams: its own end, or for a record of a multi-step plan the
    end of the plan's last record (a plan's tokens are handed over together). `records` in engine order."""
    times, until = [], None
    for r in reversed(records):
        if until is None or r.plan_step == r.plan_steps - 1:
            until = r.start_time + r.duration_s
        times.append(until)
    return times[::-1]


def entry_records(batch: Batch) -> tuple[EntryRecord, ...]:
    return tuple(EntryRecord(e.request.request_id, e.start, e.num_tokens, e.is_prefill, e.samples)
                 for e in batch.entries)
