"""`charioteer bench budget-capacity --tbt-slo-ms X`: the highest Poisson request rate that holds a TBT
SLO, for fixed token budgets (SARATHI's chunk size) and for the one `tbt_slo_ms` steers.

The engine runs in this process. A probe at rate r sends max(--min-requests, r x --duration)
requests of one workload (P prompt tokens, D output tokens, EOS ignored) at seeded Poisson arrival
times and serves them to the end; it holds when the p99 time between tokens (from the step
records) is <= the SLO and the p99 time to first token is <= --ttft-slo-ms (without a TTFT bound a
small budget "holds" any rate: its queue grows, its decodes stay fast; --ttft-slo-ms takes one
bound, or one per workload, since a long prompt's prefill alone can take seconds here). The capacity
is found by doubling from --start-rate while probes hold (halving while they fail), then
--bisections steps of bisection. One engine per budget serves every probe of its search, after a
short warm-up, so the steered budget starts each probe from what it learned (as a server would).
The budgets' searches of a workload advance together, one probe each in turn (A B C A B C ...): this
machine's speed drifts by a third over minutes, more than the budgets differ, and a search run
minutes after another would measure the drift. Rounds are repeated --repeats times; capacities are
medians with their spread.
"""
from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

from charioteer.bench.common import float_list, format_table, int_list, progress_bar
from charioteer.bench.stats import Summary
from charioteer.config import EngineArgs, add_setting_args, check_settings
from charioteer.engine.llm_engine import LLMEngine
from charioteer.engine.tbt import TimeBetweenTokens, percentile
from charioteer.request import SamplingParams

ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    output_len: int

    @property
    def name(self) -> str:
        return f"{self.prompt_len}:{self.output_len}"


def parse_workloads(text: str) -> list[Workload]:
    """argparse type: comma-separated P:D pairs of prompt and output tokens ("480:32,96:96")."""
    import argparse

    out = []
    for part in text.split(","):
        try:
            p, d = (int(v) for v in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected P:D pairs such as 480:32,96:96, got {text!r}") from None
        if p < 1 or d < 2:
            raise argparse.ArgumentTypeError(f"need P >= 1 and D >= 2 (a TBT needs two tokens), got {part!r}")
        out.append(Workload(p, d))
    return out


@dataclass
class Probe:
    rate: float
    requests: int
    tbt_p99_ms: float
    ttft_p99_ms: float
    holds: bool
    wall_s: float
    budget_last: int | None


def run_probe(engine: LLMEngine, workload: Workload, rate: float, n: int, seed: int, salt: int) -> Probe:
    """Serve `n` requests at seeded Poisson arrivals of `rate` to the end; p99 TBT and TTFT of them
    (`holds` is left for the caller: True)."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0, size=n)) / rate
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=workload.output_len, ignore_eos=True)
    tbt = TimeBetweenTokens(window=1 << 20)
    unsubscribe = engine.subscribe(tbt.observe)
    ttfts, budgets = [], []
    start, sent = time.monotonic(), 0
    while sent < n or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while sent < n and arrivals[sent] <= now:
            prompt = [(salt + 31 * sent + 7 * j + 1) % vocab for j in range(workload.prompt_len)]
            engine.add(engine.make_request(prompt, params, arrival_time=start + float(arrivals[sent])))
            sent += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(arrivals[sent] - now, 0.05)))
            continue
        for out in engine.step():
            if out.finished:
                ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        budgets.append(engine.scheduler.token_budget)
    unsubscribe()
    return Probe(rate, n, round(percentile(tbt.gaps, 0.99) * 1e3, 2), round(percentile(ttfts, 0.99) * 1e3, 2),
                 True, round(time.monotonic() - start, 2), budgets[-1] if budgets else None)


def ttft_slo_ms(args, workload: Workload) -> float:
    """--ttft-slo-ms for `workload`: its own value, or the one for every workload."""
    values = args.ttft_slo_ms
    return values[0] if len(values) == 1 else values[args.workloads.index(workload)]


def probe_slo(engine: LLMEngine, workload: Workload, rate: float, args, salt: int) -> Probe:
    """One probe at `rate` (--duration of arrivals), judged against the SLOs."""
    p = run_probe(engine, workload, rate, max(args.min_requests, round(rate * args.duration)), args.seed, salt)
    p.holds = p.tbt_p99_ms <= args.tbt_slo_ms and p.ttft_p99_ms <= ttft_slo_ms(args, workload)
    return p


def capacity_search(args):
    """A generator of the rates to probe, sent whether each held; it returns the highest rate that
    held (0 if none did): double (or halve) from --start-rate, then bisect. Gives up below
    --start-rate / 4 (slow rates make long probes) and stops doubling at --max-rate."""
    rate, lo, hi = args.start_rate, None, None
    while lo is None or hi is None:
        if (yield rate):
            lo = rate
            rate *= 2
        else:
            hi = rate
            rate /= 2
        if rate < args.start_rate / 4 or rate > args.max_rate:
            break  # nothing holds, or --max-rate holds: the capacity is at least that
    for _ in range(args.bisections if lo is not None and hi is not None else 0):
        mid = (lo + hi) / 2
        if (yield mid):
            lo = mid
        else:
            hi = mid
    return lo or 0.0


def find_capacities(probes: dict, args) -> dict:
    """Run one capacity search per key of `probes` (a function rate -> Probe), advancing them one
    probe each in turn; {key: (capacity, [Probe, ...])}."""
    searches = {key: capacity_search(args) for key in probes}
    done: dict = {}
    pending = {key: next(search) for key, search in searches.items()}
    trail: dict = {key: [] for key in probes}
    while pending:
        for key in list(pending):
            trail[key].append(probes[key](pending[key]))
            try:
                pending[key] = searches[key].send(trail[key][-1].holds)
            except StopIteration as stop:
                done[key] = (stop.value, trail[key])
                del pending[key]
    return done


def engine_for(loaded, budget, args) -> LLMEngine:
    steer = dict(tbt_slo_ms=args.tbt_slo_ms, min_chunk_size=args.min_chunk_size,
                 max_chunk_size=args.max_chunk_size) if budget == ADAPTIVE else dict(chunk_size=budget)
    return LLMEngine(EngineArgs(model=loaded.source, num_layers=args.num_layers, device=args.device, dtype=args.dtype,
                                quantization=args.quantization,
                                max_num_seqs=args.max_num_seqs, tile_size=args.tile_size, **steer,
                                # every probe of a round resends the same prompts to this engine
                                enable_prefix_caching=False), loaded=loaded)


def search_round(loaded, workload: Workload, budgets: list, args, round_index: int, progress=None) -> dict:
    """One round of a workload: every budget's capacity search, interleaved probe by probe."""
    engines = {}
    for budget in budgets:
        engines[budget] = engine_for(loaded, budget, args)
        run_probe(engines[budget], Workload(workload.prompt_len, min(workload.output_len, 8)), args.start_rate, 4,
                  args.seed + 1, salt=1)  # warm-up
    found = find_capacities({b: (lambda rate, e=engines[b]: probe_slo(e, workload, rate, args, 97 * round_index))
                             for b in budgets}, args)
    engines.clear()
    gc.collect()
    out = {}
    for budget, (capacity, probes) in found.items():
        at = next((p for p in probes if p.holds and p.rate == capacity), None)
        if args.verbose:
            for p in probes:
                print(f"  {workload.name} budget {budget}: {p.rate:.3g} req/s, p99 TBT {p.tbt_p99_ms} ms, p99 TTFT "
                      f"{p.ttft_p99_ms} ms, last budget {p.budget_last} -> {'holds' if p.holds else 'fails'}",
                      file=sys.stderr)
        out[budget] = {"capacity_rps": capacity, "tbt_p99_ms": at.tbt_p99_ms if at else None,
                       "ttft_p99_ms": at.ttft_p99_ms if at else None, "probes": [vars(p) for p in probes]}
    if progress:
        progress.update()
    return out


def run_budget_capacity(loaded, args, progress=None) -> dict:
    budgets = [*args.budgets, ADAPTIVE]
    runs: dict[tuple[str, str], list[dict]] = {(w.name, str(b)): [] for w in args.workloads for b in budgets}
    for r in range(args.repeats):
        for w in args.workloads:
            for b, found in search_round(loaded, w, budgets, args, r, progress).items():
                runs[(w.name, str(b))].append(found)
    rows = []
    for (w, b), found in runs.items():
        cap = Summary.of(f["capacity_rps"] for f in found)
        tbts = [f["tbt_p99_ms"] for f in found if f["tbt_p99_ms"] is not None]
        ttfts = [f["ttft_p99_ms"] for f in found if f["ttft_p99_ms"] is not None]
        rows.append({"workload": w, "budget": b, "capacity_rps": round(cap.median, 3),
                     "capacity_rps_spread": [round(cap.lo, 3), round(cap.hi, 3)],
                     "tbt_p99_ms": round(float(np.median(tbts)), 1) if tbts else None,
                     "ttft_p99_ms": round(float(np.median(ttfts)), 1) if ttfts else None, "searches": found})
    return {"rows": rows, "checks": capacity_checks(rows, args.workloads, args.budgets)}


def capacity_checks(rows: list[dict], workloads: list[Workload], budgets: list[int]) -> dict:
    """Per workload: the best fixed budget and adaptive / best; and which fixed budgets reach 0.95x the
    best fixed one on every workload."""
    cap = {(r["workload"], r["budget"]): r["capacity_rps"] for r in rows}
    per_workload = []
    for w in workloads:
        best = max(budgets, key=lambda b: cap[(w.name, str(b))])
        best_cap = cap[(w.name, str(best))]
        adaptive = cap[(w.name, ADAPTIVE)]
        per_workload.append({"workload": w.name, "best_fixed_budget": best, "best_fixed_rps": best_cap,
                             "adaptive_rps": adaptive,
                             "adaptive_over_best": round(adaptive / best_cap, 3) if best_cap else None})
    everywhere = [b for b in budgets if all(
        cap[(w["workload"], str(b))] >= 0.95 * w["best_fixed_rps"] > 0 for w in per_workload)]
    return {"per_workload": per_workload, "fixed_within_5pct_everywhere": everywhere}


def cmd_bench_budget_capacity(args) -> int:
    check_settings(args)
    if args.repeats < 1 or args.bisections < 0 or args.min_requests < 1:
        raise ValueError("need --repeats >= 1, --bisections >= 0 and --min-requests >= 1")
    if args.tbt_slo_ms is None:
        raise ValueError("bench budget-capacity needs --tbt-slo-ms (the SLO every budget is held to)")
    for flag in ("duration", "start_rate", "max_rate"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if len(args.ttft_slo_ms) not in (1, len(args.workloads)):
        raise ValueError(f"--ttft-slo-ms takes one bound or one per workload ({len(args.workloads)}), "
                         f"got {len(args.ttft_slo_ms)}")
    from charioteer.model.loader import load_model

    loaded = load_model(args.model, num_layers=args.num_layers)
    with progress_bar(args.repeats * len(args.workloads), "rounds") as bar:
        result = run_budget_capacity(loaded, args, bar)
    result.update({"model": loaded.config.name, "tbt_slo_ms": args.tbt_slo_ms, "ttft_slo_ms": args.ttft_slo_ms,
                   "duration_s": args.duration, "repeats": args.repeats, "max_num_seqs": args.max_num_seqs})
    if args.json:
        print(json.dumps(result))
        return 0
    ttft = ", ".join(f"{ttft_slo_ms(args, w):g}" for w in args.workloads)
    print(f"capacity (req/s) at p99 TBT <= {args.tbt_slo_ms} ms and p99 TTFT <= {ttft} ms; "
          f"{loaded.config.name}, B = {args.max_num_seqs}, median [min, max] of {args.repeats} searches")
    print(format_table(result["rows"], ["workload", "budget", "capacity_rps", "tbt_p99_ms", "ttft_p99_ms"]))
    print(format_table(result["checks"]["per_workload"],
                       ["workload", "best_fixed_budget", "best_fixed_rps", "adaptive_rps", "adaptive_over_best"]))
    everywhere = result["checks"]["fixed_within_5pct_everywhere"]
    print(f"fixed budgets within 0.95x of the best fixed one on every workload: {everywhere or 'none'}")
    return 0


def add_budget_capacity_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "budget-capacity", help="capacity under a TBT SLO: fixed token budgets against the --tbt-slo-ms one",
        description="For each workload and each budget (fixed chunk sizes, and the one --tbt-slo-ms steers), "
                    "the highest Poisson request rate whose p99 time between tokens and p99 time to first token "
                    "hold their SLOs; the engine runs in this process.")
    add_setting_args(p, ["model", "num_layers", "device", "dtype", "quantization", "max_num_seqs", "tile_size",
                         "tbt_slo_ms", "min_chunk_size", "max_chunk_size"], overrides={
        "max_num_seqs": dict(default=16),
        "tbt_slo_ms": dict(help="the p99 TBT SLO every budget is held to, and the adaptive budget's target")})
    p.add_argument("--budgets", type=int_list, default=[64, 128, 256, 512],
                   help="fixed chunk sizes to compare (default: 64,128,256,512)")
    p.add_argument("--workloads", type=parse_workloads, default=[Workload(480, 32), Workload(96, 96)],
                   help="P:D pairs of prompt and output tokens (default: 480:32,96:96)")
    p.add_argument("--ttft-slo-ms", type=float_list, default=[2000.0],
                   help="p99 TTFT SLO, one for every workload or one per workload in order (default: 2000)")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per probe (default: 8)")
    p.add_argument("--min-requests", type=int, default=4, help="requests per probe at least (default: 4)")
    p.add_argument("--start-rate", type=float, default=1.0, help="first probe, req/s (default: 1)")
    p.add_argument("--max-rate", type=float, default=64.0, help="highest probe, req/s (default: 64)")
    p.add_argument("--bisections", type=int, default=2, help="bisection steps after bracketing (default: 2)")
    p.add_argument("--repeats", type=int, default=2, help="searches per budget, interleaved (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default: 0)")
    p.add_argument("--verbose", action="store_true", help="every probe on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(func=cmd_bench_budget_capacity)
