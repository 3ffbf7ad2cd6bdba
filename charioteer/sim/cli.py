"""`charioteer simulate`: the cluster simulator from the command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from charioteer.config import SchedulerConfig, add_setting_args, setting_default
from charioteer.sim.specs import (DISPATCH_POLICIES, HARDWARE_ALIASES, HARDWARE_PRESETS, MODEL_PRESETS, PP_SCHEDULING,
                                  ClusterConfig, hardware_spec, model_shape)
from charioteer.sim.traces import trace_has_arrivals
from charioteer.sim.workload import ARRIVAL_KINDS, LENGTH_KINDS, WorkloadSpec

PRESETS = ("paper-fig12",)
DEFAULT_MODEL, DEFAULT_HARDWARE = "llama-13b", "a100-80gb"
# --validate runs the real engine on this CPU, so it uses a smaller chunk and batch cap than a
# simulated GPU cluster; an explicit --chunk-size / --max-num-seqs overrides these.
VALIDATE_DEFAULTS = {"chunk_size": 64, "max_num_seqs": 8}


def add_simulate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "simulate", help="simulate a GPU cluster running the engine's schedulers (e.g. the paper's Figure 12)",
        description="Event-driven simulation of replicas with tensor and pipeline parallelism, driving the "
                    "engine's own scheduler classes with a roofline cost model.")
    p.add_argument("--preset", choices=PRESETS, help="a ready-made experiment (overrides model/cluster/scheduler flags)")
    p.add_argument("--out", metavar="DIR", help="write summary.json, report.md and PNG plots here")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--sensitivity", action="store_true",
                   help="with --preset paper-fig12: rerun it with each cost-model, scheduling and workload factor "
                        "moved in turn and print how the completion times and ratios move (10-20 minutes)")
    p.add_argument("--validate", action="store_true",
                   help="profile the real CPU engine, then compare the simulator's per-batch times (MAPE) and "
                        "completion time against a fresh real run, per policy (--scheduler, repeatable; default: "
                        "all four), at --max-num-seqs, --chunk-size, --dtype")
    p.add_argument("--search", action="store_true",
                   help="deployment search: the highest Poisson rate within the SLOs for every TP, PP, policy, chunk "
                        "size and batch cap on --devices devices; table (or --json) and --plot")
    g = p.add_argument_group("deployment")
    g.add_argument("--model", default=None,
                   help=f"{', '.join(MODEL_PRESETS)}, a Hugging Face config.json (or its directory), or "
                        f"'layers=..,hidden=..,ffn=..,heads=..[,kv_heads=..,vocab=..,mlp=2|3]' (default: {DEFAULT_MODEL})")
    g.add_argument("--hardware", default=None, type=str.lower, choices=sorted([*HARDWARE_PRESETS, *HARDWARE_ALIASES]),
                   help=f"default: {DEFAULT_HARDWARE}")
    g.add_argument("--cost-table", default=None,
                   help="price batches from a table measured on the real engine instead of the roofline: "
                        "`charioteer tune --save-table`'s, or the step cost table `bench search-check` fits on served "
                        "steps; its model shape and device are what it measured (use --tp 1)")
    g.add_argument("--replicas", type=int, default=1)
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--intra-bw", type=float, default=None, help="intra-node link GB/s per GPU (default 300)")
    g.add_argument("--intra-lat-us", type=float, default=None, help="intra-node latency, us (default 1)")
    g.add_argument("--inter-bw", type=float, default=None, help="inter-node link GB/s per GPU (default 25)")
    g.add_argument("--inter-lat-us", type=float, default=None, help="inter-node latency, us (default 5)")
    g.add_argument("--dispatch", choices=DISPATCH_POLICIES, default="round-robin")
    g.add_argument("--pp-scheduling", choices=PP_SCHEDULING, default="virtual-engines")
    g = p.add_argument_group("scheduler")
    # Unset (None) --chunk-size and --max-num-seqs mean this command's defaults, resolved in scheduler_values.
    add_setting_args(g, ["scheduler", "chunk_size", "max_num_seqs", "tile_size", "max_num_batched_tokens"], overrides={
        "scheduler": dict(action="append", default=None, help="scheduler(s) to compare (repeatable; default: sarathi)"),
        "chunk_size": dict(type=int, default=None, help=f"SARATHI chunk size C (default: "
                           f"{setting_default('chunk_size')}; {VALIDATE_DEFAULTS['chunk_size']} with --validate)"),
        "max_num_seqs": dict(default=None, help=f"the batch cap B (default: from the memory planner; "
                             f"{VALIDATE_DEFAULTS['max_num_seqs']} with --validate)"),
    })
    g.add_argument("--max-seq-len", type=int, default=None, help="KV reserved per request (default: longest request)")
    _add_validation_args(p.add_argument_group("validation (with --validate)"))
    _add_workload_args(p.add_argument_group("workload"))
    add_search_args(p.add_argument_group("search (with --search)"))
    p.set_defaults(func=cmd_simulate)
    return p


def _add_validation_args(g) -> None:
    add_setting_args(g, ["dtype"])
    g.add_argument("--repeats", type=int, default=9,
                   help="runs of every workload, interleaved; a batch's time is its median (default: %(default)s; "
                        "with 5, this 2-core host's noise left some policies above 5 %% per-batch error)")
    g.add_argument("--validation-model", default=None,
                   help="the real engine's model for --validate, a synthetic:... spec or a checkpoint (default: "
                        "sim.validate.VALIDATION_MODEL, weights larger than a CPU's cache share; "
                        "sim.validate.SMALL_VALIDATION_MODEL runs 4-7x faster, but where its weights stay in "
                        "the L3 the steps after a large prefill cost more than any per-batch model prices)")


def add_search_args(g) -> None:
    from charioteer.sim.search import DEFAULT_TBT_P99_S, DEFAULT_TTFT_P99_S, SearchSpace

    space = SearchSpace()
    g.add_argument("--devices", type=int, default=None, help="devices to deploy on (default 8; 64 for paper-fig12)")
    g.add_argument("--slo-ttft", type=float, default=DEFAULT_TTFT_P99_S, metavar="S",
                   help=f"p99 time to first token, seconds (default {DEFAULT_TTFT_P99_S:g})")
    g.add_argument("--slo-tbt", type=float, default=DEFAULT_TBT_P99_S, metavar="S",
                   help=f"p99 time between tokens, seconds (default {DEFAULT_TBT_P99_S:g})")
    g.add_argument("--search-tp", type=_int_list, default=space.tp, metavar="LIST",
                   help=f"tensor-parallel degrees to try (default {_joined(space.tp)})")
    g.add_argument("--search-pp", type=_int_list, default=space.pp, metavar="LIST",
                   help=f"pipeline-parallel degrees to try (default {_joined(space.pp)})")
    g.add_argument("--search-policies", type=_str_list, default=space.policies, metavar="LIST",
                   help=f"policies to try (default {_joined(space.policies)})")
    g.add_argument("--search-chunk-sizes", type=_int_list, default=space.chunk_sizes, metavar="LIST",
                   help=f"sarathi chunk sizes to try (default {_joined(space.chunk_sizes)})")
    g.add_argument("--search-batch-caps", type=_str_list, default=space.batch_caps, metavar="LIST",
                   help="batch caps to try: integers, max (the memory planner's cap) or max/N "
                        f"(default {_joined(space.batch_caps)})")
    g.add_argument("--search-min-batch-cap", type=int, default=space.min_batch_cap, metavar="B",
                   help=f"leave out batch caps below this: memory-starved layouts, slow to simulate "
                        f"(default {space.min_batch_cap}; 1 tries all)")
    g.add_argument("--search-tolerance", type=float, default=0.05,
                   help="bisection stops when the rate is known to this fraction (default 0.05)")
    g.add_argument("--workers", type=int, default=None, help="processes (default: os.cpu_count())")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="write the Pareto plot here")


def _joined(values) -> str:
    return ",".join(str(v) for v in values)


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _str_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_workload_args(g) -> None:
    g.add_argument("--num-requests", type=int, default=None, help="default 1000 (10000 for paper-fig12, 2000 for --search with it)")
    g.add_argument("--lengths", choices=LENGTH_KINDS, default=None, help="default: trace with --trace, else zipf")
    g.add_argument("--min-len", type=int, default=1024)
    g.add_argument("--max-len", type=int, default=4096)
    g.add_argument("--theta", type=float, default=0.4)
    g.add_argument("--pd-ratio", type=float, default=10.0)
    g.add_argument("--prompt-len", type=int, default=None, help="fixed lengths: prompt tokens")
    g.add_argument("--decode-len", type=int, default=None, help="fixed lengths: decode tokens")
    g.add_argument("--arrivals", choices=ARRIVAL_KINDS, default=None,
                   help="default: the trace's arrival times if --trace has them, else all at 0 (zero)")
    g.add_argument("--rate", type=float, default=1.0, help="poisson arrivals, requests/s")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="requests from a trace: CSV or JSONL with arrival time, prompt and output tokens (Azure LLM "
                        "inference: TIMESTAMP, ContextTokens, GeneratedTokens; Vidur: arrived_at, num_prefill_tokens, "
                        "num_decode_tokens; or arrival_s, prompt_len, decode_len), or ShareGPT JSON conversations")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="counts a ShareGPT trace's tokens: a .gguf file or Hugging Face directory (default: the "
                        "default model's tokenizer, read locally)")
    g.add_argument("--seed", type=int, default=0)


def _cluster(args) -> ClusterConfig:
    kw = dict(replicas=args.replicas, tp=args.tp, pp=args.pp, dispatch=args.dispatch, pp_scheduling=args.pp_scheduling)
    if args.intra_bw is not None:
        kw["intra_node_bandwidth"] = args.intra_bw * 1e9
    if args.inter_bw is not None:
        kw["inter_node_bandwidth"] = args.inter_bw * 1e9
    if args.intra_lat_us is not None:
        kw["intra_node_latency"] = args.intra_lat_us * 1e-6
    if args.inter_lat_us is not None:
        kw["inter_node_latency"] = args.inter_lat_us * 1e-6
    return ClusterConfig(**kw)


def scheduler_values(args) -> dict:
    """Policies, C and B of the command: explicit flags as given, unset ones the command's defaults
    (VALIDATE_DEFAULTS with --validate), all checked by SchedulerConfig before anything runs."""
    policies = args.scheduler or [setting_default("scheduler")]
    fallback = VALIDATE_DEFAULTS if args.validate else {"chunk_size": setting_default("chunk_size"), "max_num_seqs": None}
    values = {name: fallback[name] if getattr(args, name) is None else getattr(args, name) for name in fallback}
    for policy in policies:
        SchedulerConfig(policy=policy, chunk_size=values["chunk_size"], tile_size=args.tile_size,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        **({} if values["max_num_seqs"] is None else {"max_num_seqs": values["max_num_seqs"]}))
    return {"policies": policies, **values}


def workload_spec(args, num_requests: int = 1000, arrivals: str | None = None) -> WorkloadSpec:
    """The workload flags as a WorkloadSpec (`num_requests` unless --num-requests; `arrivals` unless --arrivals)."""
    lengths = args.lengths or ("trace" if args.trace else "zipf")
    arrivals = args.arrivals or arrivals
    if arrivals is None:
        arrivals = "trace" if args.trace and trace_has_arrivals(args.trace) else "zero"
    return WorkloadSpec(num_requests=args.num_requests or num_requests, lengths=lengths, min_len=args.min_len,
                        max_len=args.max_len, theta=args.theta, pd_ratio=args.pd_ratio, prompt_len=args.prompt_len,
                        decode_len=args.decode_len, arrivals=arrivals, rate=args.rate, trace=args.trace,
                        tokenizer=args.tokenizer, seed=args.seed)


def build_runs(args):
    from charioteer.sim.runner import RunSpec, paper_fig12_specs

    if args.preset == "paper-fig12":
        specs, wspec = paper_fig12_specs(num_requests=args.num_requests or 10_000, seed=args.seed)
        return specs, wspec
    wspec = workload_spec(args)
    model, hw = model_shape(args.model or DEFAULT_MODEL), hardware_spec(args.hardware or DEFAULT_HARDWARE)
    cluster = _cluster(args)
    sched = scheduler_values(args)
    specs = []
    for policy in sched["policies"]:
        specs.append(RunSpec(f"{policy}-tp{cluster.tp}-pp{cluster.pp}-x{cluster.replicas}", policy, model, hw, cluster,
                             chunk_size=sched["chunk_size"], batch_cap=sched["max_num_seqs"],
                             max_seq_len=args.max_seq_len, tile_size=args.tile_size,
                             max_num_batched_tokens=args.max_num_batched_tokens, cost_table=args.cost_table))
    return specs, wspec


def _sensitivity(args, t0: float) -> int:
    from tqdm import tqdm

    from charioteer.sim.runner import FIG12_SENSITIVITY, fig12_paper_row, fig12_sensitivity

    if args.preset != "paper-fig12":
        raise ValueError("--sensitivity needs --preset paper-fig12")
    with tqdm(total=len(FIG12_SENSITIVITY), unit="variant", file=sys.stderr, disable=args.no_progress) as bar:
        rows = fig12_sensitivity(args.num_requests or 10_000, args.seed, progress=bar)
    if args.json:
        json.dump({"preset": args.preset, "sensitivity": rows, "wall_s": time.perf_counter() - t0}, sys.stdout, indent=2)
        print()
        return 0
    print("| variant | orca-tp-pp (s) | tp-only (s) | sarathi-tp-pp (s) | Orca TP+PP busy | bubble Orca/SARATHI "
          "| SARATHI/Orca | TP-only/Orca | SARATHI/TP-only |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        t, q = r["completion_time_s"], r["ratios"]
        print(f"| {r['variant']} | {t['orca-tp-pp']:.0f} | {t['tp-only']:.0f} | {t['sarathi-tp-pp']:.0f} "
              f"| {r['orca_tp_pp_stage_busy_pct']:.0f} % | {q['median_bubble_ratio_orca_over_sarathi']:.1f}x "
              f"| {q['speedup_sarathi_over_orca_tp_pp']:.2f}x | {q['speedup_tp_only_over_orca_tp_pp']:.2f}x "
              f"| {q['speedup_sarathi_over_tp_only']:.2f}x |")
    paper = fig12_paper_row()
    print(paper)
    return 0


def _validate(args, t0: float) -> int:
    from tqdm import tqdm

    from charioteer.sim import validate as sim_validate

    sched = scheduler_values(args)
    policies = args.scheduler or sim_validate.POLICIES
    runs = args.repeats * (len(sim_validate.CALIBRATION_POLICIES) + len(policies))
    with tqdm(total=runs, unit="run", file=sys.stderr, disable=args.no_progress) as bar:
        report = sim_validate.validate(policies=policies, batch_cap=sched["max_num_seqs"],
                                       chunk_size=sched["chunk_size"], num_requests=args.num_requests or 24,
                                       seed=args.seed + 1, repeats=args.repeats, dtype=args.dtype,
                                       model=args.validation_model or sim_validate.VALIDATION_MODEL, progress=bar)
    report["wall_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['model']}, {report['dtype']}, C = {report['chunk_size']}, B = {report['batch_cap']}, "
          f"each batch's time the median of {report['validation_runs']} runs; cost model fitted on "
          f"{report['calibration_batches']} calibration batches")
    print("measured completion: the sum of the batches' median times; the median of the runs' own totals beside it")
    print("| policy | batches | per-batch MAPE | repeat spread | measured (s) | run totals (s) | simulated (s) "
          "| completion error | same batch sequence |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in report["policies"]:
        print(f"| {r['policy']} | {r['validation_batches']} | {r['per_batch_mape'] * 100:.1f} % "
              f"| {r['repeat_spread'] * 100:.0f} % | {r['measured_completion_s']:.2f} | {r['run_totals_median_s']:.2f} "
              f"| {r['simulated_completion_s']:.2f} | {r['completion_error'] * 100:.1f} % | {r['same_batch_sequence']} |")
    return 0


def cmd_simulate(args) -> int:
    from charioteer.sim.report import report_markdown, write_outputs
    from charioteer.sim.runner import fig12_comparison, run_many

    t0 = time.perf_counter()
    if args.search:
        from charioteer.sim.search_cli import cmd_search

        return cmd_search(args, _cluster(args), workload_spec(args, 2000 if args.preset else 1000, "zero"), t0)
    if args.validate:
        return _validate(args, t0)
    if args.sensitivity:
        return _sensitivity(args, t0)
    specs, wspec = build_runs(args)
    outputs = run_many(specs, wspec, show_progress=not args.no_progress)
    summaries = [o.summary for o in outputs]
    payload = {"preset": args.preset, "workload": dataclasses.asdict(wspec), "runs": summaries}
    if args.preset == "paper-fig12":
        payload["comparison"] = fig12_comparison(summaries)
    payload["wall_s"] = time.perf_counter() - t0
    if args.out:
        write_outputs(payload, outputs, args.out, paper=args.preset == "paper-fig12")
        payload["wall_s"] = time.perf_counter() - t0
    if args.json:
        json.dump(payload, sys.stdout, indent=2)
        print()
    else:
        print(report_markdown(payload))
        if args.out:
            print(f"wrote {args.out}/report.md, summary.json and plots")
    return 0
