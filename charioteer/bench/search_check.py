"""`charioteer bench search-check`: does the deployment that `simulate --search` recommends for this CPU hold
its SLOs when the real server runs it?

1. Calibrate: serve calibration workloads (other seeds; orca, and sarathi at the smallest and largest
   chunk size searched; each all at once, then at Poisson arrivals at 0.8x the throughput that
   reached) with `charioteer serve --trace-steps`, set up as the check's server will be, and fit
   the simulator's per-step cost model on the served steps' wall times (`sim.validate.StepCostModel`,
   with the spread of measured over fitted times, so simulated p99s see the real step-to-step
   variation; saved as `rN-cost_table.json`). Served steps, not the engine alone: the server's HTTP thread
   shares the core, and its steps took about 20 % longer than in-process calibration predicted.
2. Search: `simulate --search`'s candidates and bisection (`sim.search`) on one device with that table,
   over the check's own requests: seeded lengths, and a seeded unit-rate Poisson arrival sequence that
   a rate r compresses by 1/r.
3. Serve: `charioteer serve` runs the best configuration, pinned to core 0 with one thread, while the
   client (this process) runs on the other cores. The same requests are sent at the same arrival times
   (token-id prompts of the exact lengths, EOS ignored), at the predicted capacity and at --over times it.
Steps 1-3 make a round, and --repeats rounds run. This machine's speed drifts by 10-25 % over
minutes, so each round calibrates again, just before it serves, and the rates are judged by the
median over the rounds of each p99 (TTFT, and ITL, the time between tokens): the recommendation is
confirmed when both medians hold at the capacity and one fails at --over x it. Each round's p99s,
and how fast its served steps ran against the table it was priced with, are reported.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from typing import TYPE_CHECKING

import numpy as np

from charioteer.bench.common import choices, format_table, int_list, progress_bar
from charioteer.config import SCHEDULERS, add_setting_args, check_settings

if TYPE_CHECKING:
    from charioteer.sim.validate import StepCostModel


@contextlib.contextmanager
def pinned(cpus: set[int] | None):
    """Run this thread (and the torch threads it starts) on `cpus`; None leaves it as it is."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def core_split() -> tuple[set[int] | None, set[int] | None]:
    """(server cores, client cores): the first core for the server, the rest for the client; no pinning on one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    return {cores[0]}, set(cores[1:])


def bench_requests(workload, vocab_size: int, seed: int) -> list:
    """Token-id prompts of the workload's exact prompt lengths, max_tokens its output lengths."""
    from charioteer.bench.serve import BenchRequest

    rng = np.random.default_rng(seed)
    lo, hi = min(1000, vocab_size // 2), min(20000, vocab_size)  # ordinary tokens: past the specials
    return [BenchRequest(rng.integers(lo, hi, int(p)).tolist(), int(p), int(d))
            for p, d in zip(workload.prompt_len, workload.decode_len)]


def server_gemm_rows(config, dtype: str) -> tuple[int, int]:
    """The server's Kernels.small_batch_rows and widen_rows: it runs `config` in `dtype` on this CPU, unquantized."""
    import torch

    from charioteer.model.llama import Kernels
    from charioteer.model.precision import resolve_dtype

    cpu = torch.device("cpu")
    kernels = Kernels.choose(config, cpu, resolve_dtype(dtype, cpu))
    return kernels.small_batch_rows(quantized=False), kernels.widen_rows(quantized=False)


def config_name(c: dict) -> str:
    return f"{c['policy']}" + (f" C={c['chunk_size']}" if c["chunk_size"] else "") + f" B={c['batch_cap']}"


def calibrate(args, workload_spec, vocab_size: int, gemm_rows: tuple[int, int], cpus: tuple,
              tag: str = "") -> StepCostModel:
    """Fit the step cost model on served steps. Each calibration run starts a server (as the check's will be
    started) that writes its step records (`serve --trace-steps`) and serves its requests twice: all at
    once, then at Poisson arrivals at 0.8x the throughput that reached. The second load matters: a
    request's arrival is handled by the server's HTTP thread on the same core, in the middle of steps
    (served steps with a prompt chunk ran 8-16 % over a fit made on bursts alone)."""
    from dataclasses import replace

    from charioteer.sim.search import unit_poisson_arrivals
    from charioteer.sim.validate import StepCostModel
    from charioteer.sim.workload import make_workload

    cap = max(args.batch_caps)
    runs = [("orca", None)]
    if "sarathi" in args.policies:
        runs += [("sarathi", c) for c in sorted({min(args.chunk_sizes), max(args.chunk_sizes)})]
    records = []
    with progress_bar(len(runs), "calibrating") as bar:
        for i, (policy, chunk) in enumerate(runs):
            seed = args.seed + 100 + i
            workload = make_workload(replace(workload_spec, num_requests=max(8, workload_spec.num_requests // 4),
                                             seed=seed))
            unit = unit_poisson_arrivals(len(workload), seed)
            trace = os.path.join(args.out, f"{tag}calibration-{policy}{chunk or ''}.jsonl")
            served = serve_requests(args, policy, cap, chunk, bench_requests(workload, vocab_size, seed),
                                    [np.zeros(len(workload)), lambda burst: unit / (0.8 * burst["request_throughput"])],
                                    cpus, trace=trace)
            records += [(step.plan(), step.duration_s) for run in served["steps"] for step in run]
            bar.update(1)
    return StepCostModel.fit(records, *gemm_rows)


def search(args, workload, unit_arrivals, table_path: str, engine_shape) -> tuple[dict, list[dict]]:
    from charioteer.sim.search import SLO, SearchJob, SearchSpace, best_config, candidates, run_search
    from charioteer.sim.specs import ClusterConfig, hardware_spec

    job = SearchJob(engine_shape, hardware_spec("a100-80gb"), ClusterConfig(), workload.prompt_len, workload.decode_len,
                    unit_arrivals, workload.max_seq_len, SLO(args.slo_ttft, args.slo_tbt), cost_table=table_path)
    # The device's memory only resolves 'max' caps; every cap here is a number, and SmolLM2's KV fits any of them.
    space = SearchSpace(1, (1,), (1,), tuple(args.policies), tuple(args.chunk_sizes), tuple(args.batch_caps), 1)
    found, _ = candidates(job, space)
    with progress_bar(len(found), "searching") as bar:
        configs = run_search(job, found, workers=os.cpu_count() or 1, progress=bar)
    best = best_config(configs)
    if best is None:
        raise RuntimeError("no configuration holds the SLOs at any rate in the simulator: loosen --slo-ttft/--slo-tbt")
    return best, configs


def serve_requests(args, policy: str, batch_cap: int, chunk_size: int | None, requests: list, arrivals: list,
                   cpus: tuple, trace: str | None = None, bar=None) -> dict:
    """Start `charioteer serve` (policy, cap, chunk; reserved KV; pinned to the server's cores), warm it up,
    then send `requests` once per item of `arrivals`: arrival offsets, or a function of the previous run's
    summary that gives them; the summaries of those runs."""
    from types import SimpleNamespace

    from charioteer.bench.serve import ServerProcess, run_requests, serve_args_from, served_model, summarize

    server_cpus, client_cpus = cpus
    flags = serve_args_from(SimpleNamespace(model=args.model, dtype=args.dtype, scheduler=policy, max_num_seqs=batch_cap,
                                            chunk_size=chunk_size, kv_policy="reserve"))
    flags += ["--trace-steps", trace] if trace else []
    out = {"runs": []}
    with ServerProcess(flags, cpus=server_cpus) as server, pinned(client_cpus):
        model = served_model(server.url, None)

        def send(reqs, offsets) -> dict:
            results, duration = asyncio.run(run_requests(server.url, model, reqs, offsets=offsets, ignore_eos=True,
                                                         progress=False))
            return summarize(results, duration)

        send(requests[:4], np.zeros(min(4, len(requests))))  # warm-up: allocator, first touch
        marks = [_lines(trace)] if trace else []  # a step's line is written before its tokens are sent
        for offsets in arrivals:
            out["runs"].append(send(requests, offsets(out["runs"][-1]) if callable(offsets) else offsets))
            if trace:
                marks.append(_lines(trace))
            if bar is not None:
                bar.update(1)
    if trace:
        from charioteer.engine.trace import load_trace

        steps = load_trace(trace)
        out["steps"] = [steps[a:b] for a, b in zip(marks, marks[1:])]  # each run's step records
    return out


def slos_hold(p99_ttft_ms: float, p99_itl_ms: float, failed: int, args) -> bool:
    return failed == 0 and p99_ttft_ms <= 1e3 * args.slo_ttft and p99_itl_ms <= 1e3 * args.slo_tbt


def rate_verdict(rounds: list[dict], args) -> dict:
    """One rate's rounds: the median of each p99, and whether both medians hold (no failed request anywhere)."""
    ttft = float(np.median([x["p99_ttft_ms"] for x in rounds]))
    itl = float(np.median([x["p99_itl_ms"] for x in rounds]))
    holds = slos_hold(ttft, itl, sum(x["failed"] for x in rounds), args)
    return {"p99_ttft_ms": ttft, "p99_itl_ms": itl, "slos_hold": holds, "rounds": len(rounds),
            "rounds_held": sum(x["slos_hold"] for x in rounds)}


def steps_over_fit(steps, table) -> dict:
    """Median served step time over the fitted cost (the search priced steps at the fit times its spread),
    for steps with a prompt chunk and for decode-only steps."""
    out = {}
    for name, prompt in (("prompt_steps_over_fit", True), ("decode_steps_over_fit", False)):
        ratios = [st.duration_s / table.predict(st.plan()) for st in steps if (st.num_prefill_tokens > 0) == prompt]
        out[name] = round(float(np.median(ratios)), 3) if ratios else None
    return out


def _lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def cmd_bench_search_check(args) -> int:
    check_settings(args)
    for flag in ("slo_ttft", "slo_tbt"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if not args.over > 1 or args.repeats < 1 or args.num_requests < 8:
        raise ValueError("need --over > 1, --repeats >= 1 and --num-requests >= 8")
    args.policies = choices(args.policies, SCHEDULERS, "--policies")
    from charioteer.bench.roofline import cpu_features, cpu_model
    from charioteer.model.loader import load_model
    from charioteer.sim.search import unit_poisson_arrivals
    from charioteer.sim.specs import ModelShape
    from charioteer.sim.workload import WorkloadSpec, make_workload

    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    config = load_model(args.model).config
    shape = ModelShape(config.name, config.num_layers, config.hidden_size, config.intermediate_size,
                       config.num_heads, config.num_kv_heads, config.vocab_size)
    wspec = WorkloadSpec(num_requests=args.num_requests, lengths="zipf", min_len=args.min_len, max_len=args.max_len,
                         theta=0.4, pd_ratio=args.pd_ratio, seed=args.seed)
    workload = make_workload(wspec)
    unit = unit_poisson_arrivals(len(workload), args.seed)

    cpus = core_split()
    gemm_rows = server_gemm_rows(config, args.dtype)
    requests = bench_requests(workload, config.vocab_size, args.seed)
    rounds, searches = [], []
    for r in range(1, args.repeats + 1):
        # Each round calibrates, searches and serves within minutes: the machine's speed drifts over longer.
        table = calibrate(args, wspec, config.vocab_size, gemm_rows, cpus, f"r{r}-")
        table_path = os.path.join(args.out, f"r{r}-cost_table.json")
        with open(table_path, "w") as f:
            f.write(table.to_json())
        best, configs = search(args, workload, unit, table_path, shape)
        rate = best["capacity_qps"]
        searches.append({"round": r, "cost_table": table.coefs, "best": best, "configs": configs})
        factors = (1.0, args.over)
        with progress_bar(len(factors), f"serving, round {r}") as bar:
            served = serve_requests(args, best["policy"], best["batch_cap"], best["chunk_size"], requests,
                                    [unit / (rate * f) for f in factors], cpus,
                                    trace=os.path.join(args.out, f"r{r}-check.jsonl"), bar=bar)
        for factor, m, steps in zip(factors, served["runs"], served["steps"]):
            holds = slos_hold(m["p99_ttft_ms"], m["p99_itl_ms"], m["failed_requests"], args)
            rounds.append({"round": r, "recommended": config_name(best), "rate_factor": factor,
                           "rate_qps": round(rate * factor, 3), "sim_ttft_p99_ms": round(1e3 * best["ttft_p99_s"], 1),
                           "sim_tbt_p99_ms": round(1e3 * best["tbt_p99_s"], 1),
                           "p99_ttft_ms": round(m["p99_ttft_ms"], 1), "p99_itl_ms": round(m["p99_itl_ms"], 1),
                           "failed": m["failed_requests"], "slos_hold": holds, **steps_over_fit(steps, table)})
    verdicts = {factor: rate_verdict([x for x in rounds if x["rate_factor"] == factor], args)
                for factor in (1.0, args.over)}
    result = {
        "model": config.name, "dtype": args.dtype, "cpu": cpu_model(), "cpu_features": cpu_features(), "server_cpus": sorted(cpus[0] or []),
        "num_requests": len(workload), "lengths": f"zipf {args.min_len}-{args.max_len}, P:D {args.pd_ratio:g}",
        "slo": {"ttft_p99_s": args.slo_ttft, "tbt_p99_s": args.slo_tbt}, "searches": searches, "rounds": rounds,
        "at_capacity": verdicts[1.0], "above": verdicts[args.over],
        "confirmed": verdicts[1.0]["slos_hold"] and not verdicts[args.over]["slos_hold"],
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    with open(os.path.join(args.out, "search_check.json"), "w") as f:
        json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{config.name} ({args.dtype}) on {result['cpu']} ({' '.join(result['cpu_features']) or 'no listed features'}); "
          f"{len(workload)} requests, {result['lengths']}; "
          f"SLOs p99 TTFT <= {args.slo_ttft} s, p99 TBT <= {args.slo_tbt} s")
    print("round 1's search:")
    print(format_table(sorted(searches[0]["configs"], key=lambda c: -c["capacity_qps"]),
                       ["policy", "chunk_size", "batch_cap", "capacity_qps", "ttft_p99_s", "tbt_p99_s", "limit"]))
    print(format_table(rounds, ["round", "recommended", "rate_factor", "rate_qps", "sim_ttft_p99_ms", "sim_tbt_p99_ms",
                                "p99_ttft_ms", "p99_itl_ms", "failed", "prompt_steps_over_fit",
                                "decode_steps_over_fit", "slos_hold"]))
    for factor, v in verdicts.items():
        print(f"at {factor:g}x: median p99 TTFT {v['p99_ttft_ms']:.0f} ms, median p99 ITL {v['p99_itl_ms']:.0f} ms -> "
              f"{'hold' if v['slos_hold'] else 'lost'} (held in {v['rounds_held']} of {v['rounds']} rounds)")
    print(f"{'confirmed' if result['confirmed'] else 'NOT confirmed'}  ({result['wall_s']:.0f} s; {args.out})")
    return 0


def add_search_check_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "search-check", help="check `simulate --search`'s recommendation for this CPU on the real server",
        description="Fit the simulator's step cost model on this CPU, search policy / chunk size / batch cap for "
                    "the highest rate that holds the SLOs, then run `charioteer serve` with the recommendation at "
                    "that rate and at --over times it.")
    add_setting_args(p, ["model", "dtype"])
    p.add_argument("--slo-ttft", type=float, default=3.0, help="p99 time to first token, s (default: 3)")
    p.add_argument("--slo-tbt", type=float, default=0.4, help="p99 time between tokens, s (default: 0.4)")
    p.add_argument("--policies", default="sarathi,orca,vllm", help="policies searched (default: sarathi,orca,vllm)")
    p.add_argument("--chunk-sizes", type=int_list, default=[32, 64, 128], help="sarathi's C (default: 32,64,128)")
    p.add_argument("--batch-caps", type=int_list, default=[4, 8, 16], help="max_num_seqs (default: 4,8,16)")
    p.add_argument("--num-requests", type=int, default=100, help="requests per run (default: 100)")
    p.add_argument("--min-len", type=int, default=48, help="shortest request, prompt + output tokens (default: 48)")
    p.add_argument("--max-len", type=int, default=320, help="longest request (default: 320)")
    p.add_argument("--pd-ratio", type=float, default=2.0, help="prompt : output tokens (default: 2)")
    p.add_argument("--over", type=float, default=1.3, help="the rate that must lose the SLOs, x capacity (default: 1.3)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of calibration, search, and serving at capacity and --over x it (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths, arrivals and prompts (default: 0)")
    p.add_argument("--out", default="search-check", help="folder for each round's cost table and step traces, and search_check.json")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(func=cmd_bench_search_check)
