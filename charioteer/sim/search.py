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
        return RunSpec(c.name, c.policy, self.model, self.hardware, cluster, chunk_size=c.chunk_size or 256,
                       batch_cap=c.batch_cap, max_seq_len=self.max_seq_len, cost_table=self.cost_table,
                       ttft_limit=(self.slo.ttft_p99_s, self.late_limit) if stop_early else None,
                       tbt_limit=(self.slo.tbt_p99_s, self.slow_limit) if stop_early and self.total_gaps else None)

    # p99 (numpy's linear interpolation) is above the SLO once the value at index floor(0.99 (n - 1)) of the n
    # sorted values is: once n - that index are above it, the run can stop. A run has one TTFT per request and
    # one gap per token after a request's first (EOS is ignored, KV reserved).
    @property
    def total_gaps(self) -> int:
        return int(np.maximum(self.decode_len - 1, 0).sum())

    @property
    def late_limit(self) -> int:
        """Requests whose first token must be late for the p99 TTFT to miss its SLO."""
        n = len(self.prompt_len)
        return n - math.floor(0.99 * (n - 1))

    @property
    def slow_limit(self) -> int:
        """Gaps between tokens that must be slow for the p99 TBT to miss its SLO."""
        gaps = self.total_gaps
        return gaps - math.floor(0.99 * max(gaps - 1, 0))


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


# ---- one candidate: bisection on the rate, steered by how far each run missed --------------------


def miss_ratios(job: SearchJob, result) -> tuple[float, float]:
    """How close a run came to losing each SLO: (share of requests whose first token was late, share of gaps
    between tokens that were slow), each over the share a p99 allows. Below 1 an SLO holds (up to numpy's
    interpolation between two order statistics). A run stopped early gives its shares so far, counting a
    request still without a first token as late once its deadline has passed."""
    n = result.num_requests
    ttft = result.first_token_s - result.arrival_s
    pending = np.isnan(ttft)
    overdue = pending & (result.arrival_s + job.slo.ttft_p99_s < result.makespan_s)
    decided = n - int(pending.sum()) + int(overdue.sum())
    late = int((ttft[~pending] > job.slo.ttft_p99_s).sum()) + int(overdue.sum())
    gaps = result.tbt_s
    slow = float((gaps > job.slo.tbt_p99_s).sum()) / gaps.size * job.total_gaps / job.slow_limit if gaps.size else 0.0
    return late / max(decided, 1) * n / job.late_limit, slow


def measure(job: SearchJob, c: Candidate, rate: float | None) -> dict:
    """Simulate `c` with Poisson arrivals at `rate` requests/s (None: every request at t = 0, run to its end
    for the saturation throughput; a run at a rate stops once an SLO is lost)."""
    arrivals = np.zeros_like(job.unit_arrivals) if rate is None else job.unit_arrivals / rate
    out = run_one(job.spec(c, stop_early=rate is not None), Workload(arrivals, job.prompt_len, job.decode_len))
    summary, ratios = out.summary, miss_ratios(job, out.result)
    ttft = summary["ttft_s"]["p99"]
    tbt = summary["tbt_s"]["p99"] or 0.0  # None when no request decodes twice
    holds = not summary["stopped_early"] and job.slo.holds(ttft, tbt)
    return {"rate": rate, "ttft_p99_s": ttft, "tbt_p99_s": tbt, "holds": holds, "stopped_early": summary["stopped_early"],
            "peak_held": summary["peak_held"],
            "completion_time_s": summary["completion_time_s"], **dict(zip(("ttft_ratio", "tbt_ratio"), ratios)),
            "miss_ratio": max(ratios)}


# How the miss ratio grows with the rate where nothing else says: a power of about 1.5 (measured on the
# preset's candidates: 1.2 to 1.7 near the capacity).
PRIOR_POWER = 1.5


def next_rate(lo: float, lo_ratio: float, hi: float | None, hi_ratio: float, rel_tol: float,
              guess: float | None = None, above: tuple[float, float] | None = None) -> float:
    """The next rate to simulate inside the bracket (lo holds with miss ratio lo_ratio, hi fails with
    hi_ratio; None: nothing failed yet), aimed at the rate where the miss ratio reaches 1 and, once that
    looks close to an end of the bracket, placed so that the expected verdict closes the bracket.

    The ratio grows with the rate about as a power of it (slow gaps: the share of steps that carry a
    prompt chunk; late first tokens: queueing), so the estimate is the power law through the two ends.
    Before anything held it is the power law through `hi` and `above` (the failing rate before hi; the
    power at least 1, the estimate at least hi / 4), or through the origin (at least hi / 2); before
    anything failed, PRIOR_POWER through `lo` (at most 4 lo). `guess` (a similar configuration's
    capacity) comes first while it is inside the bracket. A run that held without a single miss says
    nothing about the distance: then the estimate is the geometric middle, or right above `lo` if `lo`
    is the guess or nothing failed yet.
    """
    top = math.inf if hi is None else hi
    if guess is not None and lo < guess < top:
        estimate = guess
    elif hi is None:
        estimate = min(lo * lo_ratio ** (-1 / PRIOR_POWER), 4 * lo) if lo_ratio > 0 else lo
    elif lo > 0 and lo_ratio > 0 and hi_ratio > lo_ratio:
        estimate = lo * lo_ratio ** (-math.log(hi / lo) / math.log(hi_ratio / lo_ratio))
    elif lo == 0:
        power, floor = 1.0, hi / 2
        if above is not None and above[1] > hi_ratio > 0:
            power = max(1.0, math.log(above[1] / hi_ratio) / math.log(above[0] / hi))
            floor = hi / 4
        estimate = max(hi * hi_ratio ** (-1 / power), floor) if hi_ratio > 0 else hi / 2
    elif lo == guess:
        estimate = lo
    else:
        estimate = math.sqrt(lo * hi)
    step = 0.9 * rel_tol  # a probe this close to an end closes the bracket if the verdict is the expected one
    if estimate <= lo / (1 - step):
        estimate = lo / (1 - step)
    elif estimate >= top * (1 - step):
        estimate = top * (1 - step)
    return estimate if lo < estimate < top else (lo + top) / 2


@dataclass
class _Bracket:
    """The search's state for one candidate: the highest rate that held (`lo`, its run and miss ratio) and
    the lowest that failed (`hi`, None before any failed; `above`: the failing rate before it)."""

    lo: float = 0.0
    lo_ratio: float = 0.0
    at_lo: dict | None = None
    hi: float | None = None
    hi_ratio: float = 0.0
    above: tuple[float, float] | None = None

    def record(self, rate: float, point: dict) -> bool:
        if point["holds"]:
            self.lo, self.lo_ratio, self.at_lo = rate, point["miss_ratio"], point
        else:
            if self.hi_ratio > 0:
                self.above = (self.hi, self.hi_ratio)
            self.hi, self.hi_ratio = rate, point["miss_ratio"]
        return point["holds"]


def _measure_or_reuse(job: SearchJob, c: Candidate, rate: float, known: dict | None, counts: dict) -> dict:
    """`measure`, unless `known` (rate -> (batch cap, run), for this layout, policy and chunk size) holds a
    run at this rate whose schedulers never held as many requests as either cap: that run is the same
    under both (`SimResult.peak_held`). New runs are added to `known`."""
    cap, point = known.get(rate, (0, None)) if known is not None else (0, None)
    if point is not None and point["peak_held"] < min(cap, c.batch_cap):
        counts["reused_runs"] += 1
        return point
    counts["simulations"] += 1
    point = measure(job, c, rate)
    if known is not None:
        known[rate] = (c.batch_cap, point)
    return point


def find_capacity(job: SearchJob, c: Candidate, guess: float | None = None, known: dict | None = None) -> dict:
    """The highest Poisson rate at which `c` holds both SLOs, within `rel_tol` of a rate where they fail.

    Without a `guess`, the bracket starts at [0, saturation], saturation being the throughput with
    every request arriving at t = 0: no rate above it is sustainable. If the SLOs hold there too (a
    trace too short for queues to build), the capacity is that throughput and `limit` says so. With a
    `guess` (a similar configuration's capacity) the guess is tried first and, if it holds, a rate
    above it; the saturation run follows only if neither failed (else `saturation_qps` is None).
    Inside the bracket each rate comes from `next_rate`, which uses how far the runs so far missed;
    when two such rates in a row have not halved a bracket with a held and a failed end, the next rate
    is its middle. Runs at a rate in `known` may be reused (`_measure_or_reuse`).
    """
    t0 = time.perf_counter()
    b, counts, widths = _Bracket(), {"simulations": 0, "reused_runs": 0}, []
    saturation_qps, limit = None, "slo"

    def probe(rate: float) -> bool:
        return b.record(rate, _measure_or_reuse(job, c, rate, known, counts))

    if guess is not None and guess > 0 and probe(guess):
        # The share of slow gaps grows smoothly with the rate; the share of late first tokens jumps near
        # the capacity (queues diverge), so its ratio says little about the distance: try right above.
        smooth = b.at_lo["tbt_ratio"] >= b.at_lo["ttft_ratio"]
        probe(next_rate(b.lo, b.lo_ratio if smooth else 0.0, None, 0.0, job.rel_tol))
    if b.hi is None:  # nothing failed yet: saturation bounds the rate
        saturated = measure(job, c, None)
        counts["simulations"] += 1
        saturation_qps = len(job.unit_arrivals) / saturated["completion_time_s"]
        if saturated["holds"] or saturation_qps <= b.lo:
            if saturation_qps > b.lo:
                b.lo, b.at_lo = saturation_qps, saturated
            limit = "throughput"
        elif probe(saturation_qps):  # the top of the bracket first
            limit = "throughput"
    while (limit == "slo" and b.hi is not None and counts["simulations"] <= job.max_steps
           and b.hi - b.lo > job.rel_tol * b.hi):
        if b.lo > 0 and len(widths) >= 3 and widths[-1] > widths[-3] / 2:
            probe((b.lo + b.hi) / 2)
        else:
            probe(next_rate(b.lo, b.lo_ratio, b.hi, b.hi_ratio, job.rel_tol, guess, b.above))
        widths.append(b.hi - b.lo)
    lo, at_lo = b.lo, b.at_lo
    return {**asdict(c), "devices": c.devices, "capacity_qps": lo if at_lo else 0.0,
            "capacity_per_device": (lo if at_lo else 0.0) / c.devices,
            "ttft_p99_s": at_lo["ttft_p99_s"] if at_lo else None, "tbt_p99_s": at_lo["tbt_p99_s"] if at_lo else None,
            "failing_qps": None if limit == "throughput" else b.hi, "saturation_qps": saturation_qps,
            "limit": limit if at_lo else "slo-unmet", **counts, "wall_s": time.perf_counter() - t0}


def _family(c: Candidate) -> tuple:
    """Candidates whose capacities tend to be close: one layout, and chunked or whole prompts."""
    return c.tp, c.pp, c.policy == "sarathi"


def find_capacities(job: SearchJob, group: list[Candidate]) -> list[dict]:
    """Each candidate's capacity, in order; each starts from the last capacity found for its policy in the
    group (else the group's last), since a layout's policies and caps tend to land close together, and
    reuses the runs of the same policy and chunk size that its batch cap cannot change (`find_capacity`)."""
    results, last, runs = [], {}, {}
    for c in group:
        guess = last.get(c.policy, last.get(None))
        found = find_capacity(job, c, guess=guess or None, known=runs.setdefault((c.policy, c.chunk_size), {}))
        last[c.policy] = last[None] = found["capacity_qps"]
        results.append(found)
    return results


def run_search(job: SearchJob, found: list[Candidate], workers: int = 1, progress=None) -> list[dict]:
    """Every candidate's capacity, in the order of `found`. Candidates of one family (`_family`) run in
    order in one task, each starting from its predecessor's capacity; `workers` > 1 runs the tasks in a
    process pool, those with the most pipeline stages (the slowest to simulate) first. The results do not
    depend on `workers`."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(found):
        groups.setdefault(_family(c), []).append(i)
    order = sorted(groups.values(), key=lambda g: -found[g[0]].pp)
    results: dict[int, dict] = {}

    def collect(members: list[int], rows: list[dict]) -> None:
        results.update(zip(members, rows))
        if progress is not None:
            progress.update(len(rows))

    if workers <= 1 or len(order) <= 1:
        for members in order:
            collect(members, find_capacities(job, [found[i] for i in members]))
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(order))) as pool:
            futures = {pool.submit(find_capacities, job, [found[i] for i in members]): members for members in order}
            for future in as_completed(futures):
                collect(futures[future], future.result())
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
