"""`charioteer bench pipeline`: measured pipeline bubbles, Orca vs SARATHI, on real stage processes.

One Zipf workload (charioteer.sim.workload) runs through the engine with --pipeline-parallel-size N
(one thread per stage process) under each scheduler. Reported per run: completion time, the
per-request bubble-time distribution (charioteer/pipeline/metrics.py defines it), stage busy and
idle time, micro-batch shapes; across runs the median bubble ratio Orca / SARATHI. Then the
simulator replays the same workload with a cost model fitted to the *measured* per-stage times
(per-stage StepCostModel fits, the measured mean transfer as the link time), to compare the
measured bubbles with what it predicts.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from charioteer.sim.cost import CostModel


def add_pipeline_bench(sub) -> None:
    from charioteer.config import add_setting_args

    p = sub.add_parser(
        "pipeline", help="pipeline bubbles measured on real stage processes: Orca vs SARATHI",
        description="Run one Zipf workload with the model split into N pipeline stages (one process and "
                    "one thread each) under each scheduler; report completion time, per-request bubble "
                    "time (median, percentiles, Orca/SARATHI ratio), stage idle fractions, a plot, and "
                    "the simulator's prediction from costs fitted to the measured stage times.")
    add_setting_args(p, ["model", "num_layers", "dtype", "quantization", "pipeline_parallel_size", "scheduler",
                         "chunk_size", "micro_batch_cap", "max_num_seqs"], overrides={
        "pipeline_parallel_size": dict(default=2, dest="pipeline_parallel", help="pipeline stages N, >= 2"),
        "scheduler": dict(action="append", default=None, help="scheduler to run (repeatable; default: orca and sarathi)"),
        "chunk_size": dict(type=int, default=128, help="SARATHI chunk size C"),
        "micro_batch_cap": dict(default=8, help="requests per micro-batch at most, the paper's batch size B"),
        "max_num_seqs": dict(default=None, help="requests running at once over all micro-batches "
                                                "(default: N * --micro-batch-cap)"),
    })
    p.add_argument("--num-requests", type=int, default=24, help="default: 24")
    p.add_argument("--min-len", type=int, default=64, help="shortest prompt+decode total (default: 64)")
    p.add_argument("--max-len", type=int, default=512, help="longest prompt+decode total (default: 512)")
    p.add_argument("--theta", type=float, default=0.4, help="Zipf exponent of the totals (default: 0.4, the paper's)")
    p.add_argument("--pd-ratio", type=float, default=10.0, help="prompt:decode ratio (default: 10, the paper's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-simulate", action="store_true", help="skip the simulator comparison")
    p.add_argument("--out", default=None, help="directory for results.json and PNG plots")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_bench_pipeline)


def _records_of(metrics) -> list[dict]:
    return [{"plan": r.plan, "dispatch": r.dispatch, "returned": r.returned, "stages": r.stages,
             "bubble": r.bubble, "transfer": r.transfer} for r in metrics.records]


def run_one(loaded, policy: str, workload, args) -> dict:
    from charioteer import LLM, SamplingParams

    rng = np.random.default_rng(args.seed)
    vocab = loaded.config.vocab_size
    prompts = [rng.integers(10, vocab - 10, int(n)).tolist() for n in workload.prompt_len]
    params = [SamplingParams(temperature=0, max_tokens=int(d), ignore_eos=True) for d in workload.decode_len]
    llm = LLM(loaded, scheduler=policy, chunk_size=args.chunk_size, max_num_seqs=args.max_num_seqs,
              kv_policy="reserve", pipeline_parallel_size=args.pipeline_parallel, num_layers=args.num_layers,
              micro_batch_cap=args.micro_batch_cap, dtype=args.dtype, quantization=args.quantization)
    try:
        engine = llm.engine
        # Warm-up (allocator, first-touch of weights and KV pages), then measure from a clean slate.
        llm.generate([prompts[0][:32]] * 2, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        metrics = engine.pipeline_metrics
        metrics.reset()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        completion = time.perf_counter() - t0
        bubbles = [metrics.request_bubble_s[o.request_id] for o in outputs]
        summary = metrics.summary()
        recs = metrics.records
        run = {
            "scheduler": policy,
            "completion_time_s": completion,
            "median_bubble_s": float(np.median(bubbles)),
            "bubble_s": summary["bubble_s"],
            "bubbles_per_request_s": bubbles,
            "stage_busy_s": summary["stage_busy_s"],
            "stage_idle_s": summary["stage_idle_s"],
            "stage_idle_fraction": summary["stage_idle_fraction"],
            "stage_time_s": summary["stage_time_s"],
            "num_micro_batches": len(recs),
            "micro_batch_tokens": {"mean": float(np.mean([r.num_tokens for r in recs])),
                                   "cv": float(np.std([r.num_tokens for r in recs]) / max(1e-9, np.mean([r.num_tokens for r in recs])))},
            "micro_batch_stage_time_cv": [
                float(np.std(t) / max(1e-9, np.mean(t)))
                for t in ([r.stages[s][2] - r.stages[s][1] for r in recs] for s in range(metrics.num_stages))],
            "micro_batch_transfer_s": summary["micro_batch_transfer_s"],
            "driver_gap_s": _driver_gaps(recs, metrics.num_stages),
            "records": _records_of(metrics),
        }
        return run
    finally:
        llm.shutdown()


def _driver_gaps(recs, n: int) -> dict:
    """From a micro-batch's return to the dispatch of the one that takes its slot, N later
    (sampling, state update, scheduling, pickling in the driver)."""
    from charioteer.pipeline.metrics import percentiles

    gaps = [b.dispatch - a.returned for a, b in zip(recs, recs[n:]) if b.dispatch >= a.returned]
    return percentiles(gaps)


class _StageCost(CostModel):
    """Simulator cost model: one StepCostModel per stage, fitted to the measured stage times."""

    def __init__(self, fits, p2p_s: float) -> None:
        self.fits, self.p2p_s, self.num_stages = fits, p2p_s, len(fits)

    def batch_cost(self, plan):
        return [max(0.0, f.predict(plan)) for f in self.fits], self.p2p_s, 0.0


def simulate(runs: list[dict], workload, args) -> list[dict]:
    from charioteer.sim.simulator import ReplicaSetup, Simulator
    from charioteer.sim.specs import ClusterConfig
    from charioteer.sim.validate import StepCostModel

    n = args.pipeline_parallel
    records = [r for run in runs for r in run["records"]]
    fits = [StepCostModel.fit([(r["plan"], r["stages"][s][2] - r["stages"][s][1]) for r in records])
            for s in range(n)]
    p2p = float(np.mean([np.mean(r["transfer"][1:]) for r in records])) if n > 1 else 0.0
    out = []
    for run in runs:
        cost = _StageCost(fits, p2p)
        # "shared-capped" is the engine's micro_batch_cap: one scheduler, N * B running, B per micro-batch.
        setup = ReplicaSetup(run["scheduler"], args.micro_batch_cap, workload.max_seq_len, chunk_size=args.chunk_size)
        cluster = ClusterConfig(pp=n, pp_scheduling="shared-capped", intra_node_latency=0.0)
        result = Simulator(setup, cluster, cost).run(workload)
        out.append({"scheduler": run["scheduler"], "completion_time_s": float(result.makespan_s),
                    "median_bubble_s": float(np.median(result.bubble_s)),
                    "bubbles_per_request_s": result.bubble_s.tolist(),
                    "stage_busy_s": [float(x) for x in np.asarray(result.stage_busy_s).ravel()]})
    return out


def _ratio(runs: list[dict]) -> float | None:
    by = {r["scheduler"]: r for r in runs}
    if "orca" in by and "sarathi" in by and by["sarathi"]["median_bubble_s"] > 0:
        return by["orca"]["median_bubble_s"] / by["sarathi"]["median_bubble_s"]
    return None


def plot(result: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from charioteer.sim.report import save_figure

    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in result["runs"]:
        x = np.sort(run["bubbles_per_request_s"])
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=f"{run['scheduler']} (measured)")
    for run in result.get("simulated", []):
        x = np.sort(run["bubbles_per_request_s"])
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), "--", label=f"{run['scheduler']} (simulated)")
    ax.set_xlabel("pipeline bubble time per request (s)")
    ax.set_ylabel("fraction of requests")
    ratio = result.get("median_bubble_ratio_orca_over_sarathi")
    ax.set_title(f"PP={result['pipeline_parallel']}, median ratio Orca/SARATHI = {ratio:.2f}" if ratio else "bubbles")
    ax.grid(alpha=0.3)
    ax.legend()
    files.append(save_figure(fig, out_dir, "bubble_cdf.png"))

    runs = result["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.2 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        recs = run["records"]
        t0 = recs[0]["dispatch"] if recs else 0.0
        window = min(run["completion_time_s"], 20.0)
        cmap = plt.get_cmap("tab10")
        for i, r in enumerate(recs):
            if r["dispatch"] - t0 > window:
                break
            for s, (_, start, end) in enumerate(r["stages"]):
                ax.barh(s, end - start, left=start - t0, color=cmap(i % 10), edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(result["pipeline_parallel"]), [f"stage {s}" for s in range(result["pipeline_parallel"])])
        ax.invert_yaxis()
        ax.set_xlim(0, window)
        ax.set_title(f"{run['scheduler']}: micro-batches on the stages (first {window:.0f} s; gaps = idle)")
    axes[-1, 0].set_xlabel("seconds")
    files.append(save_figure(fig, out_dir, "timeline.png"))
    return files


def format_report(result: dict) -> str:
    precision = result["dtype"] + (f", {result['quantization']}" if result["quantization"] else "")
    lines = [f"pipeline bench: {result['model']} ({precision}), PP={result['pipeline_parallel']}, "
             f"{result['workload']['num_requests']} "
             f"requests, Zipf({result['workload']['theta']}) totals {result['workload']['min_len']}-"
             f"{result['workload']['max_len']}, P:D {result['workload']['pd_ratio']}, C={result['chunk_size']}, "
             f"max_num_seqs={result['max_num_seqs']}, micro-batch cap={result['micro_batch_cap']}", ""]
    lines.append(f"{'scheduler':<10} {'completion s':>12} {'median bubble s':>16} {'p90 bubble s':>13} "
                 f"{'stage idle %':>16} {'micro-batches':>14} {'mb stage-time CV':>17}")
    for r in result["runs"]:
        idle = "/".join(f"{100 * f:.0f}" for f in r["stage_idle_fraction"])
        cv = "/".join(f"{c:.2f}" for c in r["micro_batch_stage_time_cv"])
        lines.append(f"{r['scheduler']:<10} {r['completion_time_s']:>12.1f} {r['median_bubble_s']:>16.3f} "
                     f"{r['bubble_s']['p90']:>13.3f} {idle:>16} {r['num_micro_batches']:>14} {cv:>17}")
    ratio = result.get("median_bubble_ratio_orca_over_sarathi")
    if ratio is not None:
        lines.append(f"\nmedian bubble ratio Orca / SARATHI (measured): {ratio:.2f}")
    if result.get("simulated"):
        lines.append("simulator with costs fitted to these stage times:")
        for r in result["simulated"]:
            lines.append(f"  {r['scheduler']:<10} completion {r['completion_time_s']:.1f} s, median bubble "
                         f"{r['median_bubble_s']:.3f} s")
        if result.get("simulated_median_bubble_ratio") is not None:
            lines.append(f"  median bubble ratio Orca / SARATHI (simulated): {result['simulated_median_bubble_ratio']:.2f}")
    if result.get("files"):
        lines.append(f"\nwrote {', '.join(result['files'])} in {result['out']}")
    return "\n".join(lines)


def cmd_bench_pipeline(args) -> int:
    import torch

    from charioteer.model.loader import load_model
    from charioteer.model.precision import dtype_name, resolve_dtype
    from charioteer.sim.workload import WorkloadSpec, make_workload

    if args.pipeline_parallel < 2:
        raise ValueError(f"--pipeline-parallel-size must be >= 2, got {args.pipeline_parallel}")
    torch.set_num_threads(1)
    if args.max_num_seqs is None:
        args.max_num_seqs = args.pipeline_parallel * args.micro_batch_cap
    policies = args.scheduler or ["orca", "sarathi"]
    spec = WorkloadSpec(num_requests=args.num_requests, lengths="zipf", min_len=args.min_len, max_len=args.max_len,
                        theta=args.theta, pd_ratio=args.pd_ratio, seed=args.seed)
    workload = make_workload(spec)
    loaded = load_model(args.model, num_layers=args.num_layers, seed=args.seed)
    runs = []
    for policy in policies:
        print(f"running {policy} ...", file=sys.stderr, flush=True)
        runs.append(run_one(loaded, policy, workload, args))
    result = {
        "model": loaded.config.name, "dtype": dtype_name(resolve_dtype(args.dtype, torch.device("cpu"))),
        "quantization": args.quantization,
        "pipeline_parallel": args.pipeline_parallel, "chunk_size": args.chunk_size,
        "max_num_seqs": args.max_num_seqs, "micro_batch_cap": args.micro_batch_cap, "threads_per_stage": 1,
        "workload": {"num_requests": args.num_requests, "min_len": args.min_len, "max_len": args.max_len,
                     "theta": args.theta, "pd_ratio": args.pd_ratio, "seed": args.seed,
                     "prompt_tokens": int(workload.prompt_len.sum()), "decode_tokens": int(workload.decode_len.sum())},
        "runs": runs,
        "median_bubble_ratio_orca_over_sarathi": _ratio(runs),
    }
    if not args.no_simulate:
        result["simulated"] = simulate(runs, workload, args)
        result["simulated_median_bubble_ratio"] = _ratio(result["simulated"])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        result["out"] = args.out
        result["files"] = plot(result, args.out)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(result, f)
        result["files"].append("results.json")
    if args.json:
        slim = dict(result, runs=[{k: v for k, v in r.items() if k != "records"} for r in runs])
        print(json.dumps(slim))
    else:
        print(format_report(result))
    return 0
