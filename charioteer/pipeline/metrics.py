"""Bubble accounting from the timestamps every stage records for every micro-batch.

Each stage s records, for each micro-batch m (clock: time.time() of the stage's machine, so
bubble numbers across machines need synchronized clocks; on one machine they are exact):

    wait_begin[m, s]  the stage finished its previous work and started waiting for m's inputs
    start[m, s]       m's inputs (plan and, after the first stage, hidden states) are in; compute begins
    end[m, s]         compute done (the output is handed to the link)

and the driver records dispatch[m] (plan sent) and returned[m] (logits received). m is *ready*
for stage s at ready[m, s] = dispatch[m] for the first stage and end[m, s-1] otherwise. Then:

    busy[m, s]     = end - start
    idle[m, s]     = start - wait_begin                  the stage had nothing to do
    bubble[m, s]   = max(0, wait_begin - ready)          m was ready but the stage was still busy
                                                         with earlier micro-batches (queueing)
    transfer[m, s] = start - max(ready, wait_begin)      moving m's inputs once both were ready

The bubble time of a request is the sum of bubble[m, s] over every micro-batch m that holds it
and every stage s: the time its micro-batches waited in front of busy stages. This is the
simulator's definition (charioteer/sim/simulator.py: a micro-batch arriving at a stage that is
still busy waits free - arrive), measured instead of modelled. A stage's idle fraction is its idle
time over its busy + idle time, counted from its first micro-batch's start to its last one's end.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class MicroBatchRecord:
    index: int
    request_ids: list[str]
    plan: list[tuple[int, int, bool]]  # (num_tokens, start, is_prefill) per entry
    dispatch: float
    returned: float
    stages: list[tuple[float, float, float]]  # (wait_begin, start, end) per stage
    bubble: list[float] = field(default_factory=list)  # per stage
    transfer: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _, _ in self.plan)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, _, p in self.plan if p)


def percentiles(values, qs=(50, 90, 99)) -> dict:
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"mean": 0.0, **{f"p{q}": 0.0 for q in qs}}
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in qs}}


class PipelineMetrics:
    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.reset()

    def reset(self) -> None:
        self.records: list[MicroBatchRecord] = []
        self.request_bubble_s: dict[str, float] = defaultdict(float)
        self.request_micro_batches: dict[str, int] = defaultdict(int)
        self.stage_busy_s = [0.0] * self.num_stages
        self.stage_idle_s = [0.0] * self.num_stages
        self._stage_seen = [False] * self.num_stages

    def observe(self, step) -> None:
        """A step observer (LLMEngine.subscribe): account the micro-batch a pipeline step returned."""
        if step.pipeline is not None:
            t = step.pipeline
            self.record(step.request_ids, step.plan(), t.dispatch, t.returned,
                        [(s.wait_begin, s.start, s.end) for s in t.stages])

    def record(self, request_ids: list[str], plan, dispatch: float, returned: float,
               stages: list[tuple[float, float, float]]) -> MicroBatchRecord:
        rec = MicroBatchRecord(len(self.records), request_ids, plan, dispatch, returned, stages)
        ready = dispatch
        for s, (wait_begin, start, end) in enumerate(stages):
            rec.bubble.append(max(0.0, wait_begin - ready))
            rec.transfer.append(max(0.0, start - max(ready, wait_begin)))
            self.stage_busy_s[s] += end - start
            if self._stage_seen[s]:  # the wait before a stage's first micro-batch is start-up, not idling
                self.stage_idle_s[s] += max(0.0, start - wait_begin)
            self._stage_seen[s] = True
            ready = end
        total = sum(rec.bubble)
        for rid in request_ids:
            self.request_bubble_s[rid] += total
            self.request_micro_batches[rid] += 1
        self.records.append(rec)
        return rec

    def stage_idle_fraction(self) -> list[float]:
        return [i / (i + b) if i + b > 0 else 0.0 for i, b in zip(self.stage_idle_s, self.stage_busy_s)]

    def summary(self) -> dict:
        bubbles = list(self.request_bubble_s.values())
        recs = self.records
        return {
            "num_stages": self.num_stages,
            "num_micro_batches": len(recs),
            "stage_busy_s": self.stage_busy_s,
            "stage_idle_s": self.stage_idle_s,
            "stage_idle_fraction": self.stage_idle_fraction(),
            "median_bubble_s": float(np.median(bubbles)) if bubbles else 0.0,
            "bubble_s": percentiles(bubbles),
            "micro_batch_bubble_s": percentiles([sum(r.bubble) for r in recs]),
            "micro_batch_transfer_s": percentiles([sum(r.transfer) for r in recs]),
            "stage_time_s": [percentiles([r.stages[s][2] - r.stages[s][1] for r in recs])
                             for s in range(self.num_stages)],
        }
