"""`charioteer bench ...`: wire with `add_bench_parser(sub)` in charioteer.cli.build_parser.

`bench` is a parser of its own with sub-commands (`serve`, `capacity`); a later benchmark adds
itself with `p.bench_sub.add_parser(...)` on the parser returned here, or by a line in
`add_bench_parser`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys

from charioteer.bench.adaptive import add_adaptive_bench
from charioteer.bench.budget_capacity import add_budget_capacity_bench
from charioteer.bench.paper_cli import add_paper_benches
from charioteer.bench.partial_prefills import add_partial_prefills_bench
from charioteer.bench.prefix_caching import add_prefix_caching_bench
from charioteer.bench.peers import add_peers_bench
from charioteer.bench.pipeline import add_pipeline_bench
from charioteer.bench.serve import ENGINE_FLAGS
from charioteer.bench.search_check import add_search_check_bench
from charioteer.bench.single_stream import add_single_stream_bench
from charioteer.bench.structured import add_structured_bench
from charioteer.bench.switch import add_switch_bench
from charioteer.config import add_setting_args, check_settings

# The engine settings a `bench serve|capacity` forwards to the `charioteer serve` it starts.
SERVER_SETTINGS = [attr for attr, _ in ENGINE_FLAGS] + ["token_budget_mode"]


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmarks: the paper's experiments, roofline, serving latency and capacity",
                              description="Benchmarks. `charioteer bench <name> --help` documents each.")
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    p.bench_sub = sub  # later `bench X` commands: add_parser on this

    serve = sub.add_parser(
        "serve", help="latency of an OpenAI-compatible server under load (like `vllm bench serve`)",
        description="Stream requests to a server (--url) or to one started here (engine flags), at a "
                    "Poisson/gamma arrival rate, and report throughput and TTFT/TPOT/ITL/E2E latency.")
    _add_common(serve)
    serve.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests/s (default: inf = all at once)")
    serve.add_argument("--num-prompts", type=int, default=100, help="requests to send (default: 100)")
    serve.add_argument("--out", default=None, help="directory for results.json and latency CDF plots (PNG)")
    serve.set_defaults(func=cmd_bench_serve)

    cap = sub.add_parser(
        "capacity", help="highest request rate whose p99 TBT (ITL) stays under an SLO",
        description="Bisect over the Poisson request rate (a fixed number of prompts per probe, one "
                    "server for all probes) for the highest rate at which p99 ITL (TBT) <= --slo-tbt-ms "
                    "(and p99 TTFT <= --slo-ttft-ms if given) with no failed requests: Sarathi-Serve's "
                    "capacity metric.")
    _add_common(cap)
    cap.add_argument("--slo-tbt-ms", type=float, required=True, help="p99 ITL (TBT) SLO in ms")
    cap.add_argument("--slo-ttft-ms", type=float, default=None, help="p99 TTFT SLO in ms (default: none)")
    cap.add_argument("--num-prompts", type=int, default=64, help="requests per probe (default: 64)")
    cap.add_argument("--min-rate", type=float, default=0.25, help="lowest rate probed, req/s (default: 0.25)")
    cap.add_argument("--max-rate", type=float, default=256.0, help="highest rate probed, req/s (default: 256)")
    cap.add_argument("--start-rate", type=float, default=1.0,
                     help="first probe; doubled until the SLO breaks, then bisected (default: 1)")
    cap.add_argument("--rel-tol", type=float, default=0.1,
                     help="stop bisecting when (hi - lo) / hi is below this (default: 0.1)")
    cap.add_argument("--min-goodput-fraction", type=float, default=0.0,
                     help="a probe also fails when the achieved request throughput is below this fraction of "
                          "the offered rate: the server did not keep up (default: 0, off; the last requests' "
                          "service time biases short probes low, so use enough --num-prompts)")
    cap.add_argument("--max-probes", type=int, default=12, help="probes at most (default: 12)")
    cap.set_defaults(func=cmd_bench_capacity)
    add_pipeline_bench(sub)
    add_paper_benches(sub)
    add_adaptive_bench(sub)
    add_budget_capacity_bench(sub)
    add_peers_bench(sub)
    add_partial_prefills_bench(sub)
    add_prefix_caching_bench(sub)
    add_structured_bench(sub)
    add_single_stream_bench(sub)
    add_switch_bench(sub)
    add_search_check_bench(sub)
    return p


def _add_common(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--url", default=None,
                   help="base URL of a running server (http://host:port); without it a `charioteer serve` "
                        "is started on 127.0.0.1 with the engine flags below and stopped at the end")
    t.add_argument("--served-model-name", default=None, help="model name to send (default: the server's, from /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("CHARIOTEER_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $CHARIOTEER_API_KEY)")
    t.add_argument("--server-args", default=None,
                   help="extra `charioteer serve` flags for a started server, one string (e.g. '--max-queue 1024')")
    t.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health (default: 300)")
    t.add_argument("--request-timeout", type=float, default=600.0, help="per-request timeout, s (default: 600)")

    lg = p.add_argument_group("load")
    lg.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of inter-arrival times: 1 = Poisson (default), <1 burstier, >1 more regular")
    lg.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    lg.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals (default: 0)")
    lg.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    lg.add_argument("--ignore-eos", action="store_true",
                    help="send ignore_eos=true (a vLLM/charioteer extension, not OpenAI's) so every request "
                         "generates max_tokens")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=["synthetic", "sharegpt"], default="synthetic",
                   help="synthetic token-id prompts (default) or a ShareGPT JSON file")
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (for --dataset sharegpt)")
    d.add_argument("--input-len", type=int, default=128, help="synthetic: mean-ish prompt tokens (default: 128)")
    d.add_argument("--input-len-dist", choices=["uniform", "zipf", "fixed"], default="uniform",
                   help="synthetic prompt lengths: uniform on [min, max] (default), zipf (heavy tail from "
                        "min, clipped at max), or fixed")
    d.add_argument("--input-len-min", type=int, default=None, help="default: input-len / 2 (fixed: input-len)")
    d.add_argument("--input-len-max", type=int, default=None, help="default: 1.5 * input-len (fixed: input-len)")
    d.add_argument("--zipf-a", type=float, default=1.5, help="zipf exponent (> 1, default: 1.5)")
    d.add_argument("--output-len", type=int, default=None,
                   help="max_tokens per request (synthetic default: 32; sharegpt default: the reply's length)")
    d.add_argument("--output-len-dist", choices=["uniform", "zipf", "fixed"], default="fixed",
                   help="synthetic output lengths (default: fixed at --output-len)")
    d.add_argument("--output-len-min", type=int, default=None)
    d.add_argument("--output-len-max", type=int, default=None)
    d.add_argument("--max-input-len", type=int, default=None, help="sharegpt: skip longer prompts (estimated tokens)")
    d.add_argument("--max-output-len", type=int, default=None, help="sharegpt: clip max_tokens to this")
    d.add_argument("--token-id-range", type=int, nargs=2, default=(1000, 20000), metavar=("LO", "HI"),
                   help="synthetic prompt token ids are drawn from [LO, HI) (default: 1000 20000)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_setting_args(p.add_argument_group("engine (of a server started here, without --url)"), SERVER_SETTINGS)


def build_requests(args, n: int):
    from charioteer.bench.serve import load_sharegpt, synthetic_requests

    if n < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {n}")
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE")
        return load_sharegpt(args.dataset_path, n, seed=args.seed, output_len=args.output_len,
                             max_input_len=args.max_input_len, max_output_len=args.max_output_len)
    return synthetic_requests(
        n, input_len=args.input_len, output_len=args.output_len if args.output_len is not None else 32,
        input_dist=args.input_len_dist, input_min=args.input_len_min, input_max=args.input_len_max,
        output_dist=args.output_len_dist, output_min=args.output_len_min, output_max=args.output_len_max,
        zipf_a=args.zipf_a, token_id_range=tuple(args.token_id_range), seed=args.seed)


def _check(args) -> None:
    if not args.url:
        check_settings(args)  # of the server started here
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")


def _probe(args, url: str, model: str, requests, rate: float) -> tuple[dict, list]:
    from charioteer.bench.serve import run_requests, summarize

    results, duration = asyncio.run(run_requests(
        url, model, requests, rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        seed=args.seed, api_key=args.api_key, ignore_eos=args.ignore_eos, temperature=args.temperature,
        timeout=args.request_timeout, progress=not args.no_progress))
    m = summarize(results, duration)
    m["request_rate"] = rate if math.isfinite(rate) else "inf"
    m["burstiness"] = args.burstiness
    m["max_concurrency"] = args.max_concurrency
    return m, results


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from charioteer.bench.serve import format_report, server_for, served_model, write_outputs

    _check(args)
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    requests = build_requests(args, args.num_prompts)
    with server_for(args) as (url, pid):
        model = args.served_model_name or served_model(url, args.api_key)
        m, results = _probe(args, url, model, requests, args.request_rate)
    m.update(url=url, model=model, dataset=args.dataset, num_prompts=args.num_prompts, server_pid=pid,
             scheduler=None if args.url else args.scheduler, chunk_size=None if args.url else args.chunk_size)
    if args.out:
        m["files"] = write_outputs(args.out, m, results)
    print(json.dumps(m) if args.json else format_report(m))
    return 0 if m["successful_requests"] else 1


def search_capacity(probe, args) -> tuple[float | None, float | None]:
    """(highest passing, lowest failing) rate: bracket by doubling up from --start-rate while probes pass
    (halving down while they fail), then bisect until within --rel-tol, in --max-probes at most."""
    lo, hi, n = None, None, 0
    rate = args.start_rate
    while n < args.max_probes:
        n += 1
        if probe(rate):
            lo = rate
            if hi is not None or rate >= args.max_rate:
                break
            rate = min(rate * 2, args.max_rate)
        else:
            hi = rate
            if lo is not None or rate <= args.min_rate:
                break
            rate = max(rate / 2, args.min_rate)
    while lo is not None and hi is not None and (hi - lo) / hi > args.rel_tol and n < args.max_probes:
        n += 1
        mid = (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def format_capacity(result: dict) -> str:
    lo, hi = result["capacity_rps"], result["upper_bound_rps"]
    cap = "none (even --min-rate violates the SLO)" if lo is None else f"{lo:.3g} req/s"
    if lo is not None and hi is None:
        cap += " (--max-rate reached: capacity is at least this)"
    ttft = result["slo_ttft_ms"]
    lines = [f"capacity at p99 TBT <= {result['slo_tbt_ms']} ms"
             + (f" and p99 TTFT <= {ttft} ms" if ttft is not None else "") + f": {cap}"]
    for pr in result["probes"]:
        lines.append(f"  {pr['rate']:>8.3g} req/s  p99 ITL {pr['p99_itl_ms']:8.1f} ms  p99 TTFT "
                     f"{pr['p99_ttft_ms']:8.1f} ms  {'ok' if pr['passed'] else 'FAIL'}")
    return "\n".join(lines)


def cmd_bench_capacity(args: argparse.Namespace) -> int:
    from charioteer.bench.serve import server_for, served_model

    _check(args)
    if not (0 < args.min_rate <= args.start_rate <= args.max_rate):
        raise ValueError("need 0 < --min-rate <= --start-rate <= --max-rate")
    requests = build_requests(args, args.num_prompts)
    probes: list[dict] = []

    def ok(m: dict) -> bool:
        return (m["failed_requests"] == 0 and m["p99_itl_ms"] <= args.slo_tbt_ms
                and (args.slo_ttft_ms is None or m["p99_ttft_ms"] <= args.slo_ttft_ms)
                and m["request_throughput"] >= args.min_goodput_fraction * float(m["request_rate"]))

    with server_for(args) as (url, pid):
        model = args.served_model_name or served_model(url, args.api_key)

        def probe(rate: float) -> bool:
            m, _ = _probe(args, url, model, requests, rate)
            passed = ok(m)
            probes.append({"rate": rate, "passed": passed, "p99_itl_ms": m["p99_itl_ms"],
                           "p99_ttft_ms": m["p99_ttft_ms"], "failed_requests": m["failed_requests"],
                           "request_throughput": m["request_throughput"],
                           "output_throughput": m["output_throughput"]})
            if not args.no_progress:
                print(f"rate {rate:.3g} req/s: p99 ITL {m['p99_itl_ms']:.1f} ms, p99 TTFT {m['p99_ttft_ms']:.1f} ms"
                      f" -> {'ok' if passed else 'violates SLO'}", file=sys.stderr)
            return passed

        lo, hi = search_capacity(probe, args)
    result = {"capacity_rps": lo, "upper_bound_rps": hi, "slo_tbt_ms": args.slo_tbt_ms,
              "slo_ttft_ms": args.slo_ttft_ms, "num_prompts": args.num_prompts, "burstiness": args.burstiness,
              "url": url, "model": model, "server_pid": pid, "probes": probes,
              "scheduler": None if args.url else args.scheduler, "chunk_size": None if args.url else args.chunk_size}
    print(json.dumps(result) if args.json else format_capacity(result))
    return 0
