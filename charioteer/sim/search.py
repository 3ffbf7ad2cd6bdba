"""Deployment search (`charioteer simulate --search`): which deployment serves the most requests per device
within the SLOs.

For a model, a device type, a number of devices and a workload's request lengths, every candidate
(tensor-parallel degree, pipeline-parallel degree, policy, chunk size, batch cap; the devices left
over become replicas) is simulated with Poisson arrivals, and its capacity is the highest rate at
which the p99 time to first token and the p99 time between tokens both hold their SLOs, found by
bisection on the rate. Arrivals at rate r are one seeded unit-rate Poisson sequence divided by r,
so a higher rate is the same requests, compressed.

Candidates run in a process pool; each simulation is `runner.run_one`, the engine's schedulers
driven by the cost model.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace

import numpy as np

from charioteer.config import SCHEDULERS
from charioteer.sim.memory import plan_memory
from charioteer.sim.runner import RunSpec, run_one
from charioteer.sim.specs import ClusterConfig, HardwareSpec, ModelShape
from charioteer.sim.workload import Workload

DEFAULT_TTFT_P99_S = 10.0
DEFAULT_TBT_P99_S = 0.2


@dataclass(frozen=True)
class SLO:
    """Service-level objectives on the p99 time to first token and the p99 time between tokens, seconds."""

    ttft_p99_s: float = DEFAULT_TTFT_P99_S
    tbt_p99_s: float = DEFAULT_TBT_P99_S

    def __post_init__(self) -> None:
        for name, flag in (("ttft_p99_s", "--slo-ttft"), ("tbt_p99_s", "--slo-tbt")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"SLO {name} must be a finite number of seconds > 0, got {value!r}: set {flag}")

    def holds(self, ttft_p99_s: float, tbt_p99_s: float) -> bool:
        return ttft_p99_s <= self.ttft_p99_s and tbt_p99_s <= self.tbt_p99_s


def _positive_ints(name: str, values) -> tuple[int, ...]:
    values = tuple(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"search {name} must be integers >= 1, got {values!r}")
    return values


@dataclass(frozen=True)
class SearchSpace:
    """What the search tries. Batch caps are integers, 'max' (the memory planner's cap for the layout) or
    'max/N'; a cap above the memory planner's is lowered to it. Chunk sizes apply to sarathi only."""

    devices: int = 8
    tp: tuple[int, ...] = (1, 2, 4, 8)
    pp: tuple[int, ...] = (1, 2, 4, 8)
    policies: tuple[str, ...] = ("sarathi", "orca", "vllm")
    chunk_sizes: tuple[int, ...] = (256, 512)
    batch_caps: tuple[str | int, ...] = ("max", "max/2")
    # A layout that fits fewer requests per micro-batch than this is memory-starved: never competitive, and the
    # slowest to simulate (batches scale as 1 / B). 1 tries everything.
    min_batch_cap: int = 4

    def __post_init__(self) -> None:
        _positive_ints("devices", (self.devices,))
        _positive_ints("min batch cap", (self.min_batch_cap,))
        _positive_ints("tp degrees", self.tp)
        _positive_ints("pp degrees", self.pp)
        _positive_ints("chunk sizes", self.chunk_sizes)
        unknown = [p for p in self.policies if p not in SCHEDULERS]
        if not self.policies or unknown:
            raise ValueError(f"search policies must be among {', '.join(SCHEDULERS)}, got {list(self.policies)!r}")
        for cap in self.batch_caps:
            resolve_batch_cap(cap, 1)

    def layouts(self) -> list[tuple[int, int]]:
        return [(tp, pp) for tp in sorted(set(self.tp)) for pp in sorted(set(self.pp)) if tp * pp <= self.devices]


def resolve_batch_cap(cap: str | int, memory_cap: int) -> int:
    """An integer cap, 'max' (= memory_cap) or 'max/N', never above memory_cap."""
    text = str(cap).strip().lower()
    try:
        if text == "max":
            value = memory_cap
        elif text.startswith("max/"):
            divisor = int(text[4:])
            value = max(1, memory_cap // divisor) if divisor >= 1 else 0
        else:
            value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"batch cap {cap!r}: give an integer >= 1, 'max' or 'max/N' (N >= 1)")
    return min(value, memory_cap)


@dataclass(frozen=True)
class Candidate:
    """One deployment of the devices: `replicas` copies of a TP x PP replica running one policy."""

    tp: int
    pp: int
    replicas: int
    policy: str
    chunk_size: int | None  # sarathi's C; None for policies without chunks
    batch_cap: int

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.replicas

    @property
    def name(self) -> str:
        chunk = f"-c{self.chunk_size}" if self.chunk_size else ""
        return f"{self.policy}{chunk}-b{self.batch_cap}-tp{self.tp}-pp{self.pp}-x{self.replicas}"


@dataclass(frozen=True)
class SearchJob:
    """Everything a worker needs to find a candidate's capacity (pickled to the pool)."""

    model: ModelShape
    hardware: HardwareSpec
    cluster: ClusterConfig  # links, dispatch, pp scheduling; tp, pp, replicas come from the candidate
    prompt_len: np.ndarray
    decode_len: np.ndarray
    unit_arrivals: np.ndarray  # Poisson arrivals at 1 request/s
    max_seq_len: int
    slo: SLO
    cost_table: str | None = None
    rel_tol: float = 0.05  # bisection stops when the bracket is this narrow, relative to its top
    max_steps: int = 16  # simulations per candidate after the saturation run, at most

    def __post_init__(self) -> None:
        if not 0 < self.rel_tol < 1:
            raise ValueError(f"search tolerance must be in (0, 1), got {self.rel_tol!r}")

    def spec(self, c: Candidate, stop_early: bool = True) -> RunSpec:
        cluster = replace(self.cluster, tp=c.tp, pp=c.pp, replicas=c.replicas)
        # p99 (numpy's linear interpolation) is above the SLO once the value at index floor(0.99 (n - 1)) of
        # the n sorted values is: once n - that index are above it, the run can stop. A run has one TTFT
        # per request and one gap per token after a request's first (EOS is ignored, KV reserved).
        n, gaps = len(self.prompt_len), int(np.maximum(self.decode_len - 1, 0).sum())
        late, slow = n - math.floor(0.99 * (n - 1)), gaps - math.floor(0.99 * max(gaps - 1, 0))
        return RunSpec(c.name, c.policy, self.model, self.hardware, cluster, chunk_size=c.chunk_size or 256,
                       batch_cap=c.batch_cap, max_seq_len=self.max_seq_len, cost_table=self.cost_table,
                       ttft_limit=(self.slo.ttft_p99_s, late) if stop_early else None,
                       tbt_limit=(self.slo.tbt_p99_s, slow) if stop_early and gaps else None)


def unit_poisson_arrivals(n: int, seed: int) -> np.ndarray:
    return np.cumsum(np.random.default_rng(seed).exponential(1.0, size=n))


def candidates(job: SearchJob, space: SearchSpace) -> tuple[list[Candidate], list[str]]:
    """The deployments to try, and why each layout left out was left out."""
    found, skipped = [], []
    for tp, pp in space.layouts():
        replicas = space.devices // (tp * pp)
        try:
            if job.cost_table and tp != 1:
                raise ValueError("a measured cost table is per device (tp 1 only)")
            cluster = replace(job.cluster, tp=tp, pp=pp, replicas=replicas)
            if pp > job.model.num_layers:
                raise ValueError(f"pp {pp} is more than the {job.model.num_layers} layers")
            memory_cap = plan_memory(job.model, job.hardware, cluster, job.max_seq_len).batch_cap
        except ValueError as exc:
            skipped.append(f"tp{tp} pp{pp}: {exc}")
            continue
        caps = sorted({resolve_batch_cap(cap, memory_cap) for cap in space.batch_caps}, reverse=True)
        small = [cap for cap in caps if cap < space.min_batch_cap]
        if small:
            skipped.append(f"tp{tp} pp{pp}: batch cap {', '.join(map(str, small))} is below the minimum "
                           f"{space.min_batch_cap} (memory allows {memory_cap})")
            caps = [cap for cap in caps if cap >= space.min_batch_cap]
        for policy in space.policies:
            for chunk in (sorted(set(space.chunk_sizes)) if policy == "sarathi" else [None]):
                found += [Candidate(tp, pp, replicas, policy, chunk, cap) for cap in caps]
    return found, skipped


# ---- one candidate: bisection on the rate --------------------------------------------------------


def measure(job: SearchJob, c: Candidate, rate: float | None) -> dict:
    """Simulate `c` with Poisson arrivals at `rate` requests/s (None: every request at t = 0, run to its end
    for the saturation throughput; a run at a rate stops once its TTFT SLO is lost)."""
    arrivals = np.zeros_like(job.unit_arrivals) if rate is None else job.unit_arrivals / rate
    summary = run_one(job.spec(c, stop_early=rate is not None), Workload(arrivals, job.prompt_len, job.decode_len)).summary
    ttft = summary["ttft_s"]["p99"]
    tbt = summary["tbt_s"]["p99"] or 0.0  # None when no request decodes twice
    holds = not summary["stopped_early"] and job.slo.holds(ttft, tbt)
    return {"rate": rate, "ttft_p99_s": ttft, "tbt_p99_s": tbt, "holds": holds, "stopped_early": summary["stopped_early"],
            "completion_time_s": summary["completion_time_s"]}


def find_capacity(job: SearchJob, c: Candidate) -> dict:
    """The highest Poisson rate at which `c` holds both SLOs, within `rel_tol` of a rate where they fail.

    The bracket starts at [0, saturation], saturation being the throughput with every request
    arriving at t = 0: no rate above it is sustainable. If the SLOs hold there too (a trace too
    short for queues to build), the capacity is that throughput and `limit` says so.
    """
    t0 = time.perf_counter()
    saturated = measure(job, c, None)
    saturation_qps = len(job.unit_arrivals) / saturated["completion_time_s"]
    at_lo, lo, hi, limit, steps = None, 0.0, saturation_qps, "slo", 1
    if saturated["holds"]:
        at_lo, lo, hi, limit = saturated, saturation_qps, None, "throughput"
    while hi is not None and steps <= job.max_steps and hi - lo > job.rel_tol * hi:
        rate = hi if steps == 1 else (lo + hi) / 2  # the top of the bracket first
        point, steps = measure(job, c, rate), steps + 1
        if point["holds"]:
            lo, at_lo = rate, point
            if rate == hi:
                hi, limit = None, "throughput"
        else:
            hi = rate
    return {**asdict(c), "devices": c.devices, "capacity_qps": lo if at_lo else 0.0,
            "capacity_per_device": (lo if at_lo else 0.0) / c.devices,
            "ttft_p99_s": at_lo["ttft_p99_s"] if at_lo else None, "tbt_p99_s": at_lo["tbt_p99_s"] if at_lo else None,
            "failing_qps": hi, "saturation_qps": saturation_qps, "limit": limit if at_lo else "slo-unmet",
            "simulations": steps, "wall_s": time.perf_counter() - t0}


def _capacity_task(job: SearchJob, c: Candidate) -> dict:
    return find_capacity(job, c)


def run_search(job: SearchJob, found: list[Candidate], workers: int = 1, progress=None) -> list[dict]:
    """Every candidate's capacity, in the order of `found`; `workers` > 1 runs them in a process pool."""
    results: dict[int, dict] = {}
    if workers <= 1 or len(found) <= 1:
        for i, c in enumerate(found):
            results[i] = find_capacity(job, c)
            if progress is not None:
                progress.update(1)
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(found))) as pool:
            futures = {pool.submit(_capacity_task, job, c): i for i, c in enumerate(found)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                if progress is not None:
                    progress.update(1)
    return [results[i] for i in range(len(found))]


def best_config(results: list[dict]) -> dict | None:
    """The most requests per device within the SLOs; ties go to the lower p99 time between tokens."""
    held = [r for r in results if r["capacity_qps"] > 0]
    if not held:
        return None
    return max(held, key=lambda r: (r["capacity_per_device"], -r["tbt_p99_s"]))


def pareto_front(results: list[dict]) -> list[dict]:
    """Configurations no other beats on both capacity per device (higher) and p99 TBT (lower)."""
    held = sorted((r for r in results if r["capacity_qps"] > 0),
                  key=lambda r: (r["tbt_p99_s"], -r["capacity_per_device"]))
    front, best = [], -1.0
    for r in held:
        if r["capacity_per_device"] > best:
            front.append(r)
            best = r["capacity_per_device"]
    return front
