"""A token budget driven by a time-between-tokens SLO (`tbt_slo_ms`): a reader of step records.

Every decode in a SARATHI batch waits for the whole batch, so a request's time between tokens is
about one step's duration plus the engine's gap between steps. The step's duration grows with its
tokens (the prompt chunk C, which is the token budget, plus the decodes riding along) and with its
chunk's attention work: a chunk late in a long prompt attends to every position before it, and on
this engine such a chunk can cost twice one at the prompt's start. A step over the SLO puts a gap
over it for every decode it carries, so the p99 follows the dearest steps, not the typical one.
The controller keeps the step records of the last few seconds and, after each one:

1. fits step time = a + b x tokens + c x chunk attention pairs (query-key pairs; least squares,
   every coefficient >= 0, recent steps weighted most) over the window. It refits only while the
   window holds prompt chunks and spans at least 64 tokens: decode-only steps say nothing about
   what a chunk token costs, so the last fit stands through them. Prompt steps of too little
   spread (a budget held at one value) move only the fixed cost a, keeping the last slopes. The
   fit's tail is the 90th percentile of the last 16 prompt steps' residuals (if they all ran
   faster than the fit, the least of those gains, so a cheaper mix raises the budget even without
   spread to refit from).
   Before the first fit every token is priced at the largest step's time per token (the line
   through the origin: steeper, so growth is careful);
2. prices the dearest step a budget can plan: a full chunk at the end of the longest prompt in the
   window, with as many decodes as may ride along (`max_decodes`: B - 1 under SARATHI, so the
   budget does not swing with the load and is right when the load peaks; else the recent 90th
   percentile) and the gap between steps. It picks the largest budget whose dearest step stays
   under SLO x margin (0.85) x correction, aligned and within [min_budget, max_budget]. It rises
   at most 25% per step, and only to what fits 3% under that target (a band, so the fit's jitter
   does not move it);
3. corrects with what clients saw: once enough fresh gaps are in, a measured p99 over the SLO
   cuts the correction at once (in proportion), and a p99 under SLO x margin raises it by 10%
   back up to 1 (never past it: at light load the p99 comes from cheap steps), only while
   the fit chose the budget and the budget limited the steps (else there is nothing to learn).

Old steps leave the window after `window_s` seconds, so a change in the prompt mix (longer
contexts, more decodes) moves the fit within a few seconds. The controller only computes a
number; the engine hands it to the scheduler, and a chunk boundary never changes outputs.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from charioteer.engine.least_squares import nnls
from charioteer.engine.step_record import StepRecord
from charioteer.engine.tbt import TimeBetweenTokens, percentile

RECENT = 16  # the fit's tail is the 90th percentile of the last prompt steps' residuals
RISE_BAND = 0.97  # a budget rises only to what fits 3% under the target, and falls once it does not fit
SLOPE_SPAN = 64  # tokens of spread the window needs (with prompt chunks) before it refits the cost
RECOVERY = 1.1  # the correction's rise per window of gaps under SLO x margin
PAIRS_UNIT = 1e6  # attention pairs are fitted in millions, to keep the three features' scales near


@dataclass(frozen=True)
class _Step:
    end: float
    tokens: int
    pairs: float  # query-key pairs its prompt chunks' attention scored, in PAIRS_UNIT
    decodes: int
    prompt_end: int  # the furthest prompt position a chunk of it reached (0: no prompt work)
    duration_s: float
    gap_before_s: float | None  # idle engine time since the previous step ended
    budget_bound: bool  # the step's prompt tokens filled (most of) its budget


def chunk_pairs(start: int, tokens: int) -> float:
    """Query-key pairs of `tokens` causal queries at positions start.. over the cache before them."""
    return tokens * (start + (tokens + 1) / 2)


class TokenBudgetController:
    def __init__(self, slo_s: float, min_budget: int, max_budget: int, *, includes_decodes: bool = False,
                 max_decodes: int | None = None, align: int = 16, window_s: float = 3.0, max_steps: int = 256,
                 margin: float = 0.85, min_gaps: int = 32) -> None:
        """`includes_decodes`: the budget counts the decodes too (token-budget mode), else it is the
        prompt chunk alone (strict SARATHI). `max_decodes`: the most decodes a step with a chunk can
        carry, priced into every budget (None: the recent steps' 90th percentile)."""
        if max_decodes is not None and max_decodes < 0:
            raise ValueError(f"max_decodes must be >= 0, got {max_decodes}")
        self.max_decodes = max_decodes
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
        self._cost: tuple[float, float, float] | None = None  # (a, b, c) of the last window that could tell
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
        chunks = [e for e in record.entries if e.is_prefill]
        pairs = sum(chunk_pairs(e.start, e.num_tokens) for e in chunks) / PAIRS_UNIT
        prompt_end = max((e.start + e.num_tokens for e in chunks), default=0)
        self._steps.append(_Step(end, record.num_tokens, pairs, record.num_decode_tokens, prompt_end,
                                 record.duration_s, gap, used >= 0.75 * budget))
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
        elif (self.correction < 1.0 and p99 < self.margin * self.slo_s and self._model_bound
              and any(s.budget_bound for s in list(self._steps)[-8:])):
            # Back up to 1, never past it: at light load most gaps come from cheap steps, so a p99
            # well under the SLO says nothing about the dearest step, which the fit already prices.
            # Briskly: the fit follows a slowdown too, so a cut during one counts it twice, and a
            # budget held low meanwhile starves the prompts.
            self.correction = min(1.0, self.correction * RECOVERY)
        else:
            return
        self.tbt.clear()

    def fit(self) -> tuple[float, float, float, float] | None:
        """(a, b, c, tail): step time = a + b x tokens + c x pairs (in PAIRS_UNIT), and the 90th
        percentile of the prompt steps' residuals; None before the first window that could tell."""
        steps = list(self._steps)
        prompt_steps = [s for s in steps if s.prompt_end]
        tokens = [s.tokens for s in steps]
        half_life = self.window_s / 4  # recent steps count most, so a slowdown moves the fit at once
        if len(prompt_steps) >= 4 and max(tokens) - min(tokens) >= SLOPE_SPAN:
            root_weights = np.array([0.5 ** ((steps[-1].end - s.end) / half_life / 2) for s in steps])
            features = np.array([(1.0, s.tokens, s.pairs) for s in steps]) * root_weights[:, None]
            a, b, c = nnls(features, np.array([s.duration_s for s in steps]) * root_weights).tolist()
            if b > 0 or c > 0:
                self._cost = (a, b, c)
        elif len(prompt_steps) >= 4 and self._cost is not None:
            # Too little spread to learn slopes (a budget held at one value): keep the last slopes and
            # move the fixed cost to what these prompt steps took. Else a fit from a slower spell would
            # price every larger budget too dear and hold the budget where the steps never spread out.
            _, b, c = self._cost
            weights = np.array([0.5 ** ((steps[-1].end - s.end) / half_life) for s in prompt_steps])
            levels = np.array([s.duration_s - b * s.tokens - c * s.pairs for s in prompt_steps])
            self._cost = (max(0.0, float(weights @ levels / weights.sum())), b, c)
        if self._cost is None:
            return None
        a, b, c = self._cost
        recent = (prompt_steps or steps)[-RECENT:]
        residuals = [s.duration_s - (a + b * s.tokens + c * s.pairs) for s in recent]
        # Negative only when the recent steps all ran faster than the fit: then the budget rises,
        # the window spreads and the next refit learns the new cost.
        return a, b, c, max(residuals) if max(residuals) < 0 else max(0.0, percentile(residuals, 0.9))

    def _worst_step_s(self, cost: tuple[float, float, float, float], budget: int, decodes: float,
                      prompt_len: int) -> float:
        """The fitted time of the dearest step `budget` can plan: a full chunk at the end of the longest
        prompt in the window (or of one as long as the chunk), with the decodes. The chunk is never
        cut to the prompts seen: the budget must hold for the next, longer one too."""
        a, b, c, tail = cost
        chunk = max(0, round(budget - decodes)) if self.includes_decodes else budget
        pairs = chunk_pairs(max(prompt_len, chunk) - chunk, chunk) / PAIRS_UNIT
        return a + b * (chunk + decodes) + c * pairs + tail

    def _largest_fitting(self, cost, target: float, decodes: float, prompt_len: int) -> int:
        """The largest aligned budget whose worst step fits `target` (one align under the floor if none)."""
        candidate = math.floor(self.max_budget / self.align) * self.align
        while candidate >= self.min_budget:
            if self._worst_step_s(cost, candidate, decodes, prompt_len) <= target:
                return candidate
            candidate -= self.align
        return self.min_budget - self.align

    def _choose(self) -> int:
        if len(self._steps) < 4:
            return self.budget
        steps = list(self._steps)
        gaps = [s.gap_before_s for s in steps if s.gap_before_s is not None and s.gap_before_s < self.slo_s]
        overhead = percentile(gaps, 0.9) if gaps else 0.0
        target = self.slo_s * self.margin * self.correction - overhead
        decodes = self.max_decodes if self.max_decodes is not None else percentile([s.decodes for s in steps], 0.9)
        prompt_len = max(s.prompt_end for s in steps)
        cost = self.fit()
        if cost is None:  # no cost yet: the largest step's time per token, for every token
            largest = max(steps, key=lambda s: s.tokens)
            per_token = largest.duration_s / max(largest.tokens, 1)
            rows = target / per_token
            value = rows if self.includes_decodes else rows - decodes
            value = math.floor(value / self.align) * self.align if math.isfinite(value) else self.max_budget
        else:
            value = self._largest_fitting(cost, target, decodes, prompt_len)
            if value > self.budget:  # rise only past a band, so the fit's jitter does not move it
                value = max(self.budget, self._largest_fitting(cost, target * RISE_BAND, decodes, prompt_len))
        rise = max(math.floor(self.budget * 1.25 / self.align), self.budget // self.align + 1) * self.align
        self._model_bound = self.min_budget <= value <= min(rise, self.max_budget)
        value = min(value, rise)  # rise gradually: the fit is least sure beyond the steps it has seen
        return int(min(max(value, self.min_budget), self.max_budget))
