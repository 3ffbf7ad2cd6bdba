"""Workloads: per request (arrival time, prompt tokens, decode tokens), reproducible from a seed.

Lengths (the total prompt + decode of a request, split by a P:D ratio, or given directly):
- `zipf`: totals in [min, max] with P(total = min + r - 1) proportional to 1 / r^theta, r = 1..max-min+1
  (shorter requests more likely; theta = 0 is uniform);
- `uniform`: totals uniform in [min, max];
- `fixed`: every total (or prompt/decode pair) the same;
- `trace`: a CSV/JSONL file with prompt_len, decode_len and optionally arrival_s per line.
Arrivals: all at t = 0, Poisson at `rate` requests/s, or from the trace.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from charioteer.sim.traces import ARRIVAL_COLUMNS, read_trace

LENGTH_KINDS = ("zipf", "uniform", "fixed", "trace")
ARRIVAL_KINDS = ("zero", "poisson", "trace")


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 100
    lengths: str = "zipf"
    min_len: int = 1024
    max_len: int = 4096
    theta: float = 0.4
    pd_ratio: float = 10.0
    prompt_len: int | None = None  # `fixed` with explicit prompt/decode instead of a total and P:D
    decode_len: int | None = None
    arrivals: str = "zero"
    rate: float = 1.0  # requests/s for poisson
    trace: str | None = None
    tokenizer: str | None = None  # counts a ShareGPT trace's text: a .gguf or HF directory (None: the default model's)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.lengths not in LENGTH_KINDS:
            raise ValueError(f"workload lengths must be one of {', '.join(LENGTH_KINDS)}, got {self.lengths!r}")
        if self.arrivals not in ARRIVAL_KINDS:
            raise ValueError(f"workload arrivals must be one of {', '.join(ARRIVAL_KINDS)}, got {self.arrivals!r}")
        if "trace" in (self.lengths, self.arrivals) and not self.trace:
            raise ValueError("a trace workload needs a trace file")
        if self.lengths != "trace":
            if self.num_requests < 1:
                raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
            if not 2 <= self.min_len <= self.max_len:
                raise ValueError(f"need 2 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
            if self.theta < 0:
                raise ValueError(f"zipf theta must be >= 0, got {self.theta}")
            if not self.pd_ratio > 0:
                raise ValueError(f"pd_ratio must be > 0, got {self.pd_ratio}")
        if self.arrivals == "poisson" and not self.rate > 0:
            raise ValueError(f"poisson rate must be > 0, got {self.rate}")
        for name in ("prompt_len", "decode_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass
class Workload:
    arrival_s: np.ndarray  # float64, sorted
    prompt_len: np.ndarray  # int64
    decode_len: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def max_seq_len(self) -> int:
        return int((self.prompt_len + self.decode_len).max())


def split_total(total: np.ndarray, pd_ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Split totals into prompt and decode lengths with P / D = pd_ratio (each at least 1)."""
    decode = np.maximum(1, np.rint(total / (1.0 + pd_ratio)).astype(np.int64))
    decode = np.minimum(decode, total - 1)
    return total - decode, decode


def zipf_lengths(rng: np.random.Generator, n: int, lo: int, hi: int, theta: float) -> np.ndarray:
    ranks = np.arange(1, hi - lo + 2, dtype=np.float64)
    p = ranks ** -theta
    p /= p.sum()
    return lo + rng.choice(len(ranks), size=n, p=p).astype(np.int64)


def _tokenizer(spec: WorkloadSpec):
    if spec.tokenizer is None:
        return None  # the trace reader's default: the default model's tokenizer
    from charioteer.model.tokenizer import TextTokenizer

    if os.path.isdir(spec.tokenizer):
        return TextTokenizer.from_hf_dir(spec.tokenizer)
    if os.path.isfile(spec.tokenizer):
        return TextTokenizer.from_gguf(spec.tokenizer)
    raise ValueError(f"tokenizer {spec.tokenizer!r} not found: give a .gguf file or a Hugging Face model directory")


def make_workload(spec: WorkloadSpec) -> Workload:
    rng = np.random.default_rng(spec.seed)
    trace = read_trace(spec.trace, _tokenizer(spec)) if "trace" in (spec.lengths, spec.arrivals) else None
    if spec.lengths == "trace":
        prompt, decode = trace.prompt_len, trace.decode_len
        n = len(prompt)
    else:
        n = spec.num_requests
        if spec.lengths == "fixed" and spec.prompt_len is not None:
            prompt = np.full(n, spec.prompt_len, dtype=np.int64)
            decode = np.full(n, spec.decode_len or 1, dtype=np.int64)
        else:
            if spec.lengths == "zipf":
                total = zipf_lengths(rng, n, spec.min_len, spec.max_len, spec.theta)
            elif spec.lengths == "uniform":
                total = rng.integers(spec.min_len, spec.max_len + 1, size=n)
            else:
                total = np.full(n, spec.max_len, dtype=np.int64)
            prompt, decode = split_total(total, spec.pd_ratio)
    if (prompt < 1).any() or (decode < 1).any():
        raise ValueError("every request needs prompt_len >= 1 and decode_len >= 1")
    if spec.arrivals == "zero":
        arrival = np.zeros(n)
    elif spec.arrivals == "poisson":
        arrival = np.cumsum(rng.exponential(1.0 / spec.rate, size=n))
    else:
        if trace.arrival_s is None:
            raise ValueError(f"trace {spec.trace} has no arrival times (a column named one of "
                             f"{', '.join(ARRIVAL_COLUMNS)}): use --arrivals zero or --arrivals poisson --rate R")
        if len(trace) != n:
            raise ValueError("trace arrivals need the lengths from the same trace (lengths 'trace')")
        arrival = trace.arrival_s
    order = np.argsort(arrival, kind="stable")
    return Workload(arrival[order], prompt[order], decode[order])
