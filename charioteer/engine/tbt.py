"""Time between tokens (TBT), measured from the engine's step records.

A request's TBT is the time from the end of the step that gave it a token to the end of the step
that gave it the next one: what a streaming client sees, less the network. The steps of a
multi-step plan (`plan_steps` > 1) hand their tokens over together when the plan ends, so all of
them count from the end of the plan's last record: one gap for the plan, then zeros, as the stream
sees them. `TimeBetweenTokens` follows every request through the records, keeps the most recent
gaps and answers their p99. A preempted request's next gap is not counted (it measures the
recompute, not the budget).
"""
from __future__ import annotations

import math
from collections import deque

from charioteer.engine.step_record import StepRecord


def percentile(values, q: float) -> float:
    """The q-quantile (0..1) of `values` by the nearest-rank rule: a value that occurred."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class TimeBetweenTokens:
    max_tracked = 4096  # requests followed before those silent for `forget_after_s` are dropped
    forget_after_s = 60.0

    def __init__(self, window: int = 512) -> None:
        self.gaps: deque[float] = deque(maxlen=window)  # seconds, oldest first
        self._last_token: dict[str, float] = {}  # request id -> when its last token reached its stream
        self._plan: list[StepRecord] = []  # the records so far of a multi-step plan

    def observe(self, record: StepRecord) -> list[float]:
        """Take one step record; returns the gaps it ended (also kept in `gaps`): none until a multi-step
        plan's last record, then the whole plan's."""
        if record.plan_step == 0:
            self._plan = []
        self._plan.append(record)
        if record.plan_step < record.plan_steps - 1:
            return []
        plan, self._plan = self._plan, []
        end = record.start_time + record.duration_s  # when the plan's tokens reach their streams
        new = []
        for step in plan:
            for request_id in step.preempted:
                self._last_token.pop(request_id, None)
            for entry in step.entries:
                if not entry.samples:
                    continue
                last = self._last_token.get(entry.request_id)
                if last is not None and not entry.is_prefill:
                    new.append(end - last)
                self._last_token[entry.request_id] = end
            for request_id in step.finished:
                self._last_token.pop(request_id, None)
        self.gaps.extend(new)
        if len(self._last_token) > self.max_tracked:  # aborted requests never show up as finished
            self._last_token = {r: t for r, t in self._last_token.items() if end - t < self.forget_after_s}
        return new

    def p99(self) -> float | None:
        """p99 of the kept gaps, None before any."""
        return percentile(self.gaps, 0.99) if self.gaps else None

    def clear(self) -> None:
        """Forget the kept gaps (requests' last tokens are kept, so the next gaps still count)."""
        self.gaps.clear()
