"""Small statistics for measurements that survive noise.

Every benchmark runs each configuration several times, interleaved (A B A B, never A A B B, so a
slow drift of a shared machine lands on every configuration alike), and reports the median with
the spread: the smallest and the largest sample. A comparison whose spreads overlap is "not
distinguishable", whatever its ratio of medians.

Conventions of the result dicts: a measured quantity `x` is stored as its median under `x` and
its spread as `x_spread: [min, max]`; `cell(row, "x")` prints both ("12.3 [11.9, 12.8]").
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

FASTER, SLOWER, SAME = "faster", "slower", "not distinguishable"
SPREAD = "_spread"  # suffix of a quantity's [min, max]


def median(samples: Iterable[float]) -> float:
    values = list(samples)
    if not values:
        raise ValueError("median of no samples")
    return statistics.median(values)


def spread(samples: Iterable[float]) -> tuple[float, float]:
    """(min, max) of the samples."""
    values = list(samples)
    if not values:
        raise ValueError("spread of no samples")
    return min(values), max(values)


@dataclass(frozen=True)
class Summary:
    """Median and spread (min, max) of `n` samples."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, samples: Iterable[float]) -> Summary:
        values = list(samples)
        lo, hi = spread(values)
        return cls(median(values), lo, hi, len(values))

    def overlaps(self, other: Summary) -> bool:
        return self.lo <= other.hi and other.lo <= self.hi


def interleaved(runs: Sequence[tuple[K, Callable[[], T]]] | dict[K, Callable[[], T]], repeats: int,
                warmup: int = 0, after_each: Callable[[], None] | None = None) -> dict[K, list[T]]:
    """Call every run once per round, in the given order, for `repeats` rounds (A B A B ...).

    `warmup` rounds come first and are not kept. Returns each key's results in round order, so
    the i-th results of all keys come from the same round (for paired differences or ratios).
    `after_each` is called after every kept call (a progress bar's update, say).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    pairs = list(runs.items()) if isinstance(runs, dict) else list(runs)
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"interleaved runs need distinct keys, got {keys}")
    for _ in range(warmup):
        for _, fn in pairs:
            fn()
    out: dict[K, list[T]] = {k: [] for k in keys}
    for _ in range(repeats):
        for k, fn in pairs:
            out[k].append(fn())
            if after_each:
                after_each()
    return out


def verdict(a: Sequence[float], b: Sequence[float], higher_is_better: bool = True) -> dict:
    """How A compares with B: {"ratio", "ratio_spread", "verdict"}.

    ratio is A's advantage as a ratio of medians: median(A) / median(B) for a rate (higher is
    better), median(B) / median(A) for a time, so above 1 means A is ahead either way.
    ratio_spread is the range of ratios the two spreads allow ([min(A) / max(B), max(A) / min(B)]
    for a rate; None for an end that divides by zero or less). The verdict is "faster" or "slower"
    only when the spreads (min to max) do not overlap, which is when ratio_spread lies wholly above
    or below 1; otherwise "not distinguishable". One sample on either side has no spread and is
    never distinguishable. Samples are expected to be positive.
    """
    sa, sb = Summary.of(a), Summary.of(b)
    num, den = (sa, sb) if higher_is_better else (sb, sa)
    ratio = num.median / den.median if den.median > 0 else None
    lo = num.lo / den.hi if den.hi > 0 else None
    hi = num.hi / den.lo if den.lo > 0 else None
    if sa.n < 2 or sb.n < 2 or sa.overlaps(sb):
        word = SAME
    else:
        word = FASTER if (sa.lo > sb.hi) == higher_is_better else SLOWER
    return {"ratio": _round(ratio), "ratio_spread": [_round(lo), _round(hi)], "verdict": word}


def compare(row: dict, name: str, a: Sequence[float], b: Sequence[float], higher_is_better: bool = True,
            verdict_name: str | None = None) -> dict:
    """Store verdict(a, b): the ratio under `name`, its spread under `name_spread` and the word under
    `verdict_name` (default `name_verdict`)."""
    v = verdict(a, b, higher_is_better)
    row[name] = v["ratio"]
    row[name + SPREAD] = v["ratio_spread"]
    row[verdict_name or name + "_verdict"] = v["verdict"]
    return v


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def put(row: dict, name: str, samples: Sequence[float], scale: float = 1.0, digits: int = 3) -> Summary:
    """Store the samples' median under `name` and [min, max] under `name_spread`, each times `scale`."""
    s = Summary.of(samples)
    row[name] = round(s.median * scale, digits)
    row[name + SPREAD] = [round(s.lo * scale, digits), round(s.hi * scale, digits)]
    return s


def put_mfu(row: dict, name: str, samples: Sequence[float | None]) -> None:
    """`put` for MFU samples from roofline.mfu, where None (no MFU for that rate) makes the cell None."""
    if any(v is None for v in samples):
        row[name], row[name + SPREAD] = None, None
    else:
        put(row, name, samples)


def number(v) -> str:
    """A number as the tables print it: 3 significant digits below 10, one decimal above."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def cell(row: dict, column: str) -> str:
    """A table cell: the value, and its spread when the row has one ("12.3 [11.9, 12.8]")."""
    value = row.get(column)
    rng = row.get(column + SPREAD)
    if value is None:
        return "-"
    if rng is None:
        return number(value)
    lo, hi = ("-inf" if rng[0] is None else number(rng[0])), ("inf" if rng[1] is None else number(rng[1]))
    return f"{number(value)} [{lo}, {hi}]"
