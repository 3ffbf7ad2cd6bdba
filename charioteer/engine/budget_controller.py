"""A token budget driven by a time-between-tokens SLO (`tbt_slo_ms`): a reader of step records.

Every decode in a SARATHI batch waits for the whole batch, so a request's time between tokens is
about one step's duration plus the engine's gap between steps. The step's duration grows with its
tokens: the prompt chunk C (the token budget) plus the decodes riding along. The controller keeps
the step records of the last few seconds and, after each one:

1. predicts step time from tokens in the step: the 90th percentile of the durations in the
   16-token bucket with the most steps (over its last 16, so a slowdown shows within a few
   steps, and a stray slow step does not count), plus a slope in
   seconds per token from the line through every bucket's 90th percentile (weighted by its steps);
   with one bucket only, the line through the origin (steeper: growth is careful);
2. picks the largest budget whose predicted step time (with the recent 90th-percentile decode
   count and gap between steps) stays under SLO x margin x correction, rounded down to the
   alignment and held within [min_budget, max_budget]; it rises at most 25% per step;
3. corrects with what clients saw: once enough fresh gaps are in, a measured p99 over the SLO
   cuts the correction at once (in proportion), and a p99 well under it raises the correction
   slowly, but only while the fit chose the budget and the budget limited the steps (else there is
   nothing to learn).

Old steps leave the window after `window_s` seconds, so a change in the prompt mix (longer
contexts, more decodes) moves the fit within a few seconds. The controller only computes a
number; the engine hands it to the scheduler, and a chunk boundary never changes outputs.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from charioteer.engine.step_record import StepRecord
from charioteer.engine.tbt import TimeBetweenTokens, percentile

BUCKET_TOKENS = 16
RECENT = 16  # a bucket's time is the 90th percentile of its last steps, so a slowdown shows at once


@dataclass(frozen=True)
class _Step:
    end: float
    tokens: int
    decodes: int
    duration_s: float
    gap_before_s: float | None  # idle engine time since the previous step ended
    budget_bound: bool  # the step's prompt tokens filled (most of) its budget


class TokenBudgetController:
    def __init__(self, slo_s: float, min_budget: int, max_budget: int, *, includes_decodes: bool = False,
                 align: int = 16, window_s: float = 3.0, max_steps: int = 256, margin: float = 0.9,
                 min_gaps: int = 32) -> None:
        """`includes_decodes`: the budget counts the decodes too (token-budget mode), else it is the
        prompt chunk alone (strict SARATHI)."""
        if not slo_s > 0:
            raise ValueError(f"the TBT SLO must be > 0 s, got {slo_s}")
        if not 1 <= min_budget <= max_budget:
            raise ValueError(f"need 1 <= min_budget <= max_budget, got {min_budget}, {max_budget}")
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        self.slo_s, self.min_budget, self.max_budget = slo_s, min_budget, max_budget
        self.includes_decodes, self.align = includes_decodes, align
        self.window_s, self.margin, self.min_gaps = window_s, margin, min_gaps
        self.budget = min_budget  # safe until the first steps are measured
        self.correction = 1.0  # scales the time target from what clients measured
        self.tbt = TimeBetweenTokens(window=1024)  # gaps since the correction last moved
        self.recent_tbt = TimeBetweenTokens(window=512)  # the last gaps, for reporting
        self._steps: deque[_Step] = deque(maxlen=max_steps)
        self._prev_end: float | None = None
        self._model_bound = False  # the fit (not a bound or the rise limit) chose the last budget
        self.history: list[tuple[int, int]] = []  # (step index, budget) at each change

    @property
    def tbt_p99_s(self) -> float | None:
        """p99 time between tokens over the last gaps clients saw."""
        return self.recent_tbt.p99()

    def observe(self, record: StepRecord) -> int:
        """Take one step record; returns the budget for the next steps."""
        end = record.start_time + record.duration_s
        gap = None if self._prev_end is None else max(0.0, record.start_time - self._prev_end)
        self._prev_end = end
        budget = record.token_budget or self.budget
        used = record.num_tokens if self.includes_decodes else record.num_prefill_tokens
        self._steps.append(_Step(end, record.num_tokens, record.num_decode_tokens, record.duration_s, gap,
                                 used >= 0.75 * budget))
        while len(self._steps) > 8 and self._steps[0].end < end - self.window_s:
            self._steps.popleft()
        self.tbt.observe(record)
        self.recent_tbt.observe(record)
        self._correct()
        chosen = self._choose()
        if chosen != self.budget:
            self.budget = chosen
            self.history.append((record.index, chosen))
        return self.budget

    def _correct(self) -> None:
        if len(self.tbt.gaps) < self.min_gaps:
            return
        p99 = self.tbt.p99()
        if p99 > self.slo_s:
            self.correction = max(0.1, self.correction * max(0.5, 0.95 * self.slo_s / p99))
        elif p99 < 0.75 * self.slo_s and self._model_bound and any(s.budget_bound for s in list(self._steps)[-8:]):
            self.correction = min(1.5, self.correction * 1.03)
        else:
            return
        self.tbt.clear()

    def fit(self) -> tuple[float, float, float] | None:
        """(anchor tokens, its step time, seconds per token) over the window, None before 4 steps.

        The anchor is the 16-token bucket holding the most steps (in steady state: the current
        budget's), its time the 90th percentile of their durations; the slope is the weighted line
        through every bucket's 90th percentile, or where that is unsure (one bucket, a slope <= 0),
        the anchor's time per token (the line through the origin: steeper, so growth is careful); the
        fitted slope is held within [1/4, 1] of that one.
        """
        if len(self._steps) < 4:
            return None
        buckets: dict[int, list[_Step]] = {}
        for s in self._steps:
            buckets.setdefault(s.tokens // BUCKET_TOKENS, []).append(s)
        points = [(sum(s.tokens for s in b) / len(b), percentile([s.duration_s for s in b[-RECENT:]], 0.9), len(b))
                  for b in buckets.values()]
        anchor_n, anchor_t, _ = max(points, key=lambda p: (p[2], p[0]))
        through_origin = anchor_t / max(anchor_n, 1)
        slope = through_origin
        if len(points) >= 2:
            w = sum(p[2] for p in points)
            mx = sum(n * k for n, _, k in points) / w
            my = sum(t * k for _, t, k in points) / w
            sxx = sum(k * (n - mx) ** 2 for n, _, k in points)
            fitted = sum(k * (n - mx) * (t - my) for n, t, k in points) / sxx
            # A slope above the line through the origin means a negative intercept: noise. One far
            # below it would let a few noisy buckets throw the budget up.
            slope = min(max(fitted, through_origin / 4), through_origin)
        return anchor_n, anchor_t, slope

    def _choose(self) -> int:
        line = self.fit()
        if line is None:
            return self.budget
        anchor_n, anchor_t, per_token = line
        steps = list(self._steps)
        gaps = [s.gap_before_s for s in steps if s.gap_before_s is not None and s.gap_before_s < self.slo_s]
        overhead = percentile(gaps, 0.9) if gaps else 0.0
        decodes = percentile([s.decodes for s in steps], 0.9)
        target = self.slo_s * self.margin * self.correction - overhead
        rows = anchor_n + (target - anchor_t) / per_token
        value = rows if self.includes_decodes else rows - decodes
        value = math.floor(value / self.align) * self.align if math.isfinite(value) else self.max_budget
        rise = max(math.floor(self.budget * 1.25 / self.align), self.budget // self.align + 1) * self.align
        self._model_bound = self.min_budget <= value <= min(rise, self.max_budget)
        value = min(value, rise)  # rise gradually: the fit is least sure beyond the steps it has seen
        return int(min(max(value, self.min_budget), self.max_budget))
