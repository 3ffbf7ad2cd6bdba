"""`charioteer bench adaptive`: a workload whose P:D shifts mid-run, adaptive C against static Cs.

The same engine serves phase after phase (for example P:D 50 then 5); every phase's requests
arrive together once the previous phase has drained, so each phase's throughput is its own tokens
over its own wall time, and an adaptive scheduler carries what it learned into the next phase
and has to notice the shift.
"""
from __future__ import annotations

import gc
import json
import time

from charioteer.bench import experiments as ex
from charioteer.bench.common import (add_setup_args, float_list, format_table, int_list, load_setup, prepare_device,
                                     progress_bar)
from charioteer.bench.e2e import Workload, add_requests, engine_args
from charioteer.config import add_setting_args
from charioteer.engine.llm_engine import LLMEngine


def run_phases(loaded, chunk_size, phases: list[Workload], batch_size: int, device: str = "cpu",
               tile_size: int | None = None, tune_table: str | None = None, min_chunk: int = 16,
               max_chunk: int = 512, precision: dict | None = None) -> dict:
    longest = max(phases, key=lambda w: w.seq_len)
    engine = LLMEngine(engine_args("sarathi", chunk_size, batch_size, longest, device, tile_size, tune_table=tune_table,
                                   min_chunk_size=min_chunk, max_chunk_size=max_chunk, **(precision or {})),
                      loaded=loaded)
    out = []
    for k, w in enumerate(phases):
        add_requests(engine, w, salt=97 * k)
        start = time.perf_counter()
        chunks = []
        while engine.has_unfinished_requests():
            engine.step()
            chunks.append(engine.scheduler.chunk_size)
        elapsed = time.perf_counter() - start
        out.append({"phase": k, "pd_ratio": w.pd_ratio, "prompt_len": w.prompt_len, "decode_len": w.decode_len,
                    "elapsed_s": round(elapsed, 3),
                    "throughput_tok_s": round(w.num_requests * w.seq_len / elapsed, 2),
                    "chunk_size_first": chunks[0], "chunk_size_last": chunks[-1]})
    del engine
    gc.collect()
    total_tokens = sum(w.num_requests * w.seq_len for w in phases)
    total_s = sum(p["elapsed_s"] for p in out)
    return {"chunk_size": chunk_size, "phases": out, "throughput_tok_s": round(total_tokens / total_s, 2)}


def compare(loaded, static_chunks: list[int], phases: list[Workload], batch_size: int, device: str, tile_size,
            tune_table, progress=None, precision: dict | None = None) -> dict:
    runs = []
    for chunk in ["auto", *static_chunks]:
        runs.append(run_phases(loaded, chunk, phases, batch_size, device, tile_size=tile_size, tune_table=tune_table,
                               precision=precision))
        if progress:
            progress.update()
    auto, static = runs[0], runs[1:]
    checks = []
    for k in range(len(phases)):
        best = max(static, key=lambda r: r["phases"][k]["throughput_tok_s"])
        ratio = auto["phases"][k]["throughput_tok_s"] / best["phases"][k]["throughput_tok_s"]
        checks.append({"phase": k, "best_static_chunk": best["chunk_size"], "auto_over_best": round(ratio, 3),
                       "within_5pct": ratio >= 0.95})
    worst = min(static, key=lambda r: r["throughput_tok_s"])
    return {"runs": runs, "phase_checks": checks, "worst_static_chunk": worst["chunk_size"],
            "auto_over_worst": round(auto["throughput_tok_s"] / worst["throughput_tok_s"], 3)}


def cmd_bench_adaptive(args) -> int:
    pds = args.pd_ratios
    phases = [Workload(args.seq_len, pd, args.num_requests) for pd in pds]
    roof = prepare_device(args)
    setup = load_setup(args, roof)
    with progress_bar(1 + len(args.chunk_sizes), "runs") as bar:
        result = compare(setup.loaded, args.chunk_sizes, phases, args.max_num_seqs, args.device, args.tile_size,
                         args.tune_table, bar, precision=setup.precision)
    result.update({"batch_size": args.max_num_seqs, "seq_len": args.seq_len, "num_requests_per_phase": args.num_requests,
                   "pd_ratios": pds, "tile_size": args.tile_size, "roofline": roof, "model": setup.model.config.name,
                   "threads": ex.threads()})
    if args.json:
        print(json.dumps(result))
        return 0
    rows = []
    for run in result["runs"]:
        row = {"chunk_size": run["chunk_size"], "overall_tok_s": run["throughput_tok_s"]}
        for p in run["phases"]:
            row[f"phase{p['phase']}_tok_s"] = p["throughput_tok_s"]
        rows.append(row)
    cols = ["chunk_size", *[f"phase{k}_tok_s" for k in range(len(phases))], "overall_tok_s"]
    print(f"P:D by phase: {', '.join(map(str, pds))}; L = {args.seq_len}, B = {args.max_num_seqs}, "
          f"{args.num_requests} requests per phase")
    print(format_table(rows, cols))
    print(format_table(result["phase_checks"], ["phase", "best_static_chunk", "auto_over_best", "within_5pct"]))
    print(f"auto over the worst static C ({result['worst_static_chunk']}): {result['auto_over_worst']}x")
    return 0


def add_adaptive_bench(bench_sub) -> None:
    p = bench_sub.add_parser("adaptive", help="adaptive chunk size against static ones on a P:D that shifts",
                             description="Serve phases of requests with different P:D ratios on one engine, with "
                                         "chunk_size='auto' and with each static chunk size; report throughput per phase.")
    add_setup_args(p)
    p.add_argument("--pd-ratios", type=float_list, default=[50, 5], help="P:D of each phase (default: 50,5)")
    p.add_argument("--chunk-sizes", type=int_list, default=[17, 33, 49, 113, 241],
                   help="static chunk sizes to compare (default: 17,33,49,113,241: C + 15 = 32..256 rows)")
    p.add_argument("--seq-len", type=int, default=256, help="sequence length (default: 256)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per phase (default: 64)")
    add_setting_args(p, ["max_num_seqs", "tile_size", "tune_table"], overrides={
        "max_num_seqs": dict(default=16),
        "tile_size": dict(default=64, help="auto aligns C + B - 1 to this many rows (default: 64, this CPU's "
                                           "packed-GEMM step)"),
        "tune_table": dict(help="auto picks C from this `charioteer tune --save-table` table (default: none)")})
    p.set_defaults(func=cmd_bench_adaptive)

