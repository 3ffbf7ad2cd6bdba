"""`charioteer profile` and `charioteer bench decode-speedup|e2e|chunk-ablation|tile|paper|roofline`.

Wire with `add_profile_parser(sub)` and `add_paper_benches(bench_sub)`.
"""
from __future__ import annotations

import json
import os
import sys
import time

from charioteer.bench import experiments as ex
from charioteer.bench.common import (add_setup_args, check_repeats, emit, float_list, format_table, int_list,
                                     load_setup, prepare_device, progress_bar, run_meta)
from charioteer.bench.e2e import POLICIES
from charioteer.bench.report import DECODE_SPEEDUP_COLUMNS, E2E_COLUMNS, PEAK_COLUMNS
from charioteer.bench.stats import cell

CHUNK_ABLATION_COLUMNS = ["chunk_size", "prefill_attention_ms", "attention_speedup", "prefill_total_ms",
                          "prefill_speedup", "prefill_speedup_verdict", "pd_ratio", "e2e_speedup", "e2e_verdict"]
from charioteer.config import add_setting_args


# ---- commands ---------------------------------------------------------------------------


def cmd_profile(args) -> int:
    check_repeats(args.repeats)
    roof = prepare_device(args)
    setup = load_setup(args, roof)
    with progress_bar(ex.profile_steps(args.fig3_batch_sizes, args.repeats), "profile") as bar:
        result = ex.profile(setup, args.seq_len, args.batch_size, tuple(args.fig3_batch_sizes), args.repeats, bar)
    result.update(run_meta(args, setup, roof))
    cols = ["batch", "prefill_tokens", "decodes", "preproj_ms", "attention_ms", "postproj_ms", "ffn_ms",
            "other_ms", "total_ms", "ms_per_token", "mfu"]
    text = (f"Table 2: per-operation time, sequence length {args.seq_len}, batch size {args.batch_size}; "
            f"median [min, max] of {args.repeats} interleaved runs (per-op columns: medians)\n"
            f"{format_table(result['table2'], cols)}\n"
            f"decode cost per token: {cell(result, 'decode_ms_per_token_alone')} ms alone, "
            f"{cell(result, 'decode_ms_per_token_in_hybrid')} ms piggybacked in the hybrid batch "
            f"({cell(result, 'decode_speedup_in_hybrid')}x, {result['decode_speedup_in_hybrid_verdict']}; "
            f"paper: 12.49 -> 1.2 ms, 10.4x)\n\n"
            f"Figure 3: decode over prefill cost per token (paper, one LLaMA-13B layer on A6000, 1K: "
            f"200x, 100x, 16.7x at batch 1, 2, 18)\n"
            f"{format_table(result['figure3'], ['batch_size', 'prefill_ms_per_token', 'decode_ms_per_token', 'decode_over_prefill'])}")
    emit(args, result, text)
    return 0


def cmd_decode_speedup(args) -> int:
    check_repeats(args.repeats)
    roof = prepare_device(args)
    setup = load_setup(args, roof, max_cached_tokens=max(args.seq_lens) * max(args.batch_sizes) + args.chunk_size)
    with progress_bar(ex.decode_speedup_steps(args.seq_lens, args.batch_sizes, args.repeats), "decode-speedup") as bar:
        result = ex.decode_speedup(setup, tuple(args.seq_lens), tuple(args.batch_sizes), args.chunk_size, args.repeats, bar)
    result.update(run_meta(args, setup, roof))
    emit(args, result, f"Figure 8: decode speedup, chunk size {args.chunk_size} (paper: >10x at batch 2, "
                        f"2.8x at batch 18, 1K); median [min, max] of {args.repeats} interleaved runs; verdict: "
                        f"a piggybacked decode against a decode alone\n"
                        f"{format_table(result['rows'], DECODE_SPEEDUP_COLUMNS)}")
    return 0


def cmd_e2e(args) -> int:
    check_repeats(args.repeats)
    roof = prepare_device(args)
    setup = load_setup(args, roof)
    steps = ex.e2e_steps(args.chunk_sizes, args.pd_ratios, args.max_num_seqs, args.policies, args.repeats)
    with progress_bar(steps, "e2e runs") as bar:
        result = ex.e2e(setup, tuple(args.chunk_sizes), tuple(args.pd_ratios), args.max_num_seqs, args.seq_len,
                        args.num_requests, tuple(args.policies), args.repeats, bar)
    result.update(run_meta(args, setup, roof))
    emit(args, result, format_e2e(result))
    return 0


def format_e2e(result: dict) -> str:
    lines = [f"Figures 9, 11: end-to-end throughput, L = {result['seq_len']}, B = {result['batch_size']}, "
             f"{result['num_requests']} requests (paper, 1K, B = 18: sarathi C=256 peaks at 1.27x near P:D 14; "
             f"Orca best case 1.11x, worst case 1.0x); median [min, max] of {result['repeats']} interleaved runs; "
             "gains are ratios of medians, verdicts from the spreads; roofline_gain and mfu_ceiling: each policy's "
             "batches (the simulator planning them with the engine's scheduler) at the roofline's peak and bandwidth "
             "alone, the most this machine allows",
             format_table(result["rows"], E2E_COLUMNS), "",
             "P:D of the peak against the balanced point C/(B-1):",
             format_table(result["peaks"], PEAK_COLUMNS) if result["peaks"] else
             "  none: the gains are against request-level, which --policies left out"]
    breakdown = [r for r in result["rows"] if "ops_s" in r and r["policy"] in ("request-level", "sarathi")]
    if breakdown:
        lines += ["", "Figure 10: seconds per operation over the whole run (medians), at the balanced P:D points"]
        lines.append(format_table([{"policy": r["policy"], "chunk_size": r["chunk_size"], "pd_ratio": r["pd_ratio"],
                                    **r["ops_s"], "total": r["elapsed_s"], "total_spread": r.get("elapsed_s_spread")}
                                   for r in breakdown],
                                  ["policy", "chunk_size", "pd_ratio", "preproj", "attention", "postproj", "ffn", "other", "total"]))
    return "\n".join(lines)


def cmd_chunk_ablation(args) -> int:
    check_repeats(args.repeats)
    roof = prepare_device(args)
    setup = load_setup(args, roof)
    with progress_bar(ex.chunk_ablation_steps(args.seq_len, args.chunk_sizes, args.repeats, not args.no_e2e),
                      "chunk ablation") as bar:
        result = ex.chunk_ablation(setup, args.seq_len, tuple(args.chunk_sizes), args.max_num_seqs, args.num_requests,
                                   args.repeats, not args.no_e2e, bar)
    result.update(run_meta(args, setup, roof))
    emit(args, result, f"Figure 13: chunk-size ablation, prompt of {args.seq_len} tokens (whole prompt: "
                        f"{cell(result, 'whole_prefill_ms')} ms, attention {cell(result, 'whole_prefill_attention_ms')} "
                        f"ms); median [min, max] of {args.repeats} interleaved runs\n"
                        f"{format_table(result['rows'], CHUNK_ABLATION_COLUMNS)}")
    return 0


def cmd_tile(args) -> int:
    check_repeats(args.repeats)
    roof = prepare_device(args)
    setup = load_setup(args, roof)
    with progress_bar(ex.tile_steps(args.start, args.stop), "tile") as bar:
        result = ex.tile_sweep(setup, args.start, args.stop, args.repeats, args.threshold, bar)
    result.update(run_meta(args, setup, roof))
    steps = result["steps"]
    text = "\n".join([
        f"Figure 7: prefill iteration time, {args.start}..{args.stop} tokens in steps of 1 (paper, A6000: "
        f"256 -> 257 tokens takes 69.8 -> 92.3 ms, tile 128); median [min, max] of {args.repeats} interleaved runs",
        format_table(result["points"], ["tokens", "ms", "gflops", "mfu"]),
        "steps found: " + (", ".join(f"{s['tokens']} tokens (+{s['jump']:.0%})" for s in steps) if steps else "none"),
    ])
    emit(args, result, text)
    return 0


def cmd_roofline(args) -> int:
    from charioteer.bench.roofline import (decode_attention_stream, decode_gemm_stream, describe, matmul_sweep, observe,
                                           prefill_attention_sweep)

    roof = prepare_device(args)
    extra, sections, rates = {}, [], []
    if args.sweep:
        extra["matmul_sweep"] = matmul_sweep(args.device)
        if roof["dtype"] == "float32":
            rates += [v for row in extra["matmul_sweep"] for k, v in row.items() if k.endswith("_gflops")]
        sections.append("fp32 GFLOP/s of a 22016 x 4096 weight (LLaMA-7B gate/up) by batch rows:\n"
                        + format_table(extra["matmul_sweep"], ["rows", "linear_gflops", "packed_gflops", "panel_gflops",
                                                                     "engine_gemm"]))
    if args.decode_stream:
        if args.rows < 1:
            raise ValueError(f"--rows must be at least 1, got {args.rows}")
        check_repeats(args.repeats)
        extra["decode_gemm_stream"] = decode_gemm_stream(args.device, rows=args.rows, repeats=args.repeats)
        rates += [row["gflops"] for row in extra["decode_gemm_stream"] if row["compute"] == roof["dtype"]]
        sections.append(f"One {args.rows}-row decode step's linear layers of SmolLM2-135M "
                        f"(weights streamed from memory), median [min, max] of {args.repeats} interleaved rounds:\n"
                        + format_table(extra["decode_gemm_stream"],
                                       ["backend", "ms", "weight_gbs", "gflops", "weight_mb", "lm_head_ms", "lm_head_gbs"]))
    if args.attention:
        check_repeats(args.repeats)
        extra["prefill_attention"] = prefill_attention_sweep(roof["dtype"], repeats=args.repeats)
        sections.append(f"A prompt chunk's attention in {roof['dtype']} per backend, median [min, max] of "
                        f"{args.repeats} interleaved rounds (sdpa_over: SDPA's median time over the backend's):\n"
                        + format_table(extra["prefill_attention"],
                                       ["model", "tokens", "start", "backend", "ms", "gflops", "sdpa_over"]))
    if args.decode_attention:
        check_repeats(args.repeats)
        extra["decode_attention"] = decode_attention_stream(roof["dtype"], repeats=args.repeats)
        sections.append(f"Decode attention on a {roof['dtype']} KV cache read from memory, median [min, max] of "
                        f"{args.repeats} interleaved rounds (of_read: over the read bandwidth of the same rounds):\n"
                        + (format_table(extra["decode_attention"], ["model", "decodes", "context", "us_per_call",
                                                                     "kv_gbs", "read_gbs", "of_read"])
                           if extra["decode_attention"] else "(the CPU kernels do not run here: nothing to time)"))
    # A rate the sweeps observe above the peak of the dtype it computed in raises that peak (a measured rate
    # is a lower bound); the matmul sweep and all but the bf16 backends of the decode stream compute in fp32.
    if rates and observe(roof, max(rates) * 1e9):
        print(describe(roof), file=sys.stderr)
    emit(args, {**roof, **extra}, "\n".join([json.dumps(roof, indent=2), *sections]))
    return 0


def cmd_paper(args) -> int:
    from charioteer.bench.report import write_report

    check_repeats(args.repeats)
    roof = prepare_device(args)
    setup = load_setup(args, roof)
    plan = ex.paper_plan(args.quick, args.repeats)
    os.makedirs(args.out, exist_ok=True)
    results: dict = {"quick": args.quick, "plan": plan}
    started = time.perf_counter()
    with progress_bar(ex.paper_steps(plan), "paper") as bar:
        for name, run in (("profile", ex.profile), ("decode_speedup", ex.decode_speedup), ("e2e", ex.e2e),
                          ("chunk_ablation", ex.chunk_ablation), ("tile", ex.tile_sweep)):
            begun = time.perf_counter()
            extra = {"e2e_result": results["e2e"]} if name == "chunk_ablation" and ex.shared_e2e(plan) else {}
            results[name] = run(setup, **plan[name], **extra, progress=bar)
            results[name]["wall_s"] = round(time.perf_counter() - begun, 1)
    results.update(run_meta(args, setup, roof))
    results["paper"] = ex.PAPER  # the paper's numbers, for comparison
    results["wall_s"] = round(time.perf_counter() - started, 1)
    summary = write_report(results, args.out)
    results["summary"] = summary
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    emit(args, {"out": args.out, "summary": summary, "wall_s": results["wall_s"]},
          f"wrote {args.out}/report.md, results.json and plots in {results['wall_s']} s\n"
          + json.dumps(summary, indent=2))
    return 0


# ---- parsers ----------------------------------------------------------------------------


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="per-operation times of prefill, decode and hybrid batches (Table 2, Figure 3)",
                       description="Time each operation (preproj, attention, postproj, ffn, other) of a prefill-only, "
                                   "a decode-only and a hybrid batch on the real model: the paper's Table 2. Also "
                                   "prints decode over prefill cost per token by batch size (Figure 3).")
    add_setup_args(p)
    p.add_argument("--seq-len", type=int, default=256, help="sequence length L (default: 256; the paper's 1K / 4)")
    p.add_argument("--batch-size", type=int, default=4,
                   help="requests in each measured batch of Table 2, a batch shape (default: 4, as the paper)")
    p.add_argument("--fig3-batch-sizes", type=int_list, default=[1, 2, 16],
                   help="Figure 3 batch sizes, the last being the maximum (default: 1,2,16)")
    p.add_argument("--repeats", type=int, default=5,
                   help="interleaved timed runs of every batch; median and spread are reported (default: 5)")
    p.set_defaults(func=cmd_profile)


def add_paper_benches(bench_sub) -> None:
    """`bench decode-speedup`, `e2e`, `chunk-ablation`, `tile`, `paper` and `roofline`."""
    for add in (_add_decode_speedup, _add_e2e, _add_chunk_ablation, _add_tile, _add_paper, _add_roofline):
        add(bench_sub)


def _add_decode_speedup(bench_sub) -> None:
    p = bench_sub.add_parser("decode-speedup", help="decode speedup of piggybacked decodes by batch size (Figure 8)",
                             description="Baseline decode-only time per token over the marginal time per decode "
                                         "piggybacked on a prompt chunk, by batch size and sequence length.")
    add_setup_args(p)
    p.add_argument("--seq-lens", type=int_list, default=[256, 512, 768], help="context lengths (default: 256,512,768)")
    p.add_argument("--batch-sizes", type=int_list, default=[2, 4, 8, 12, 16], help="batch sizes >= 2 (default: 2,4,8,12,16)")
    add_setting_args(p, ["chunk_size"], overrides={"chunk_size": dict(
        type=int, default=32, help="prompt chunk of the hybrid batch (default: 32, so chunk + 15 decodes stays "
                                   "within 64 rows)")})
    p.add_argument("--repeats", type=int, default=7,
                   help="interleaved timed runs of each point's three batches; median and spread are reported (default: 7)")
    p.set_defaults(func=cmd_decode_speedup)


def _add_e2e(bench_sub) -> None:
    p = bench_sub.add_parser("e2e", help="end-to-end throughput over P:D and chunk size (Figures 9, 10, 11)",
                             description="Run the paper's workload (all requests of length L at one P:D ratio, batch "
                                         "size B) to completion under each policy and chunk size.")
    add_setup_args(p)
    p.add_argument("--chunk-sizes", type=int_list, default=[17, 33, 49],
                   help="sarathi chunk sizes (default: 17,33,49: C + B - 1 = 32, 48, 64 rows)")
    p.add_argument("--pd-ratios", type=float_list, default=[0.5, 1, 2, 4, 8, 16],
                   help="P:D ratios; each chunk size's balanced C/(B-1) is added (default: 0.5,1,2,4,8,16)")
    add_setting_args(p, ["max_num_seqs"], overrides={"max_num_seqs": dict(default=16)})
    p.add_argument("--seq-len", type=int, default=256, help="sequence length L = P + D (default: 256)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per run (default: 64)")
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES),
                   help=f"comma-separated, from {','.join(POLICIES)} (default: all)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of every configuration at a P:D, interleaved; median and spread are reported (default: 3)")
    p.set_defaults(func=cmd_e2e)


def _add_chunk_ablation(bench_sub) -> None:
    p = bench_sub.add_parser("chunk-ablation", help="prefill attention, prefill and e2e time by chunk size (Figure 13)",
                             description="Chunked against whole-prompt prefill time (attention and total), and "
                                         "end-to-end throughput at each chunk size's balanced P:D against request-level.")
    add_setup_args(p)
    p.add_argument("--seq-len", type=int, default=256, help="prompt / sequence length (default: 256)")
    p.add_argument("--chunk-sizes", type=int_list, default=[17, 33, 49, 64, 96, 128],
                   help="chunk sizes (default: 17,33,49,64,96,128)")
    add_setting_args(p, ["max_num_seqs"], overrides={"max_num_seqs": dict(default=16, help="the batch cap B of "
                                                                                     "the e2e part")})
    p.add_argument("--num-requests", type=int, default=64, help="requests per e2e run (default: 64)")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved timed runs of every chunk batch, and e2e runs of each policy (default: 3)")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end part (Figure 13c)")
    p.set_defaults(func=cmd_chunk_ablation)


def _add_tile(bench_sub) -> None:
    p = bench_sub.add_parser("tile", help="iteration time by token count in steps of 1 (Figure 7)",
                             description="Time a prefill of n tokens for every n in [start, stop] and report any step "
                                         "(tile or wave quantization) in the curve.")
    add_setup_args(p)
    p.add_argument("--start", type=int, default=1, help="first token count (default: 1)")
    p.add_argument("--stop", type=int, default=160, help="last token count (default: 160)")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved timed runs of every point; steps are found on the medians (default: 3)")
    p.add_argument("--threshold", type=float, default=0.08, help="relative jump that counts as a step (default: 0.08)")
    p.set_defaults(func=cmd_tile)


def _add_paper(bench_sub) -> None:
    p = bench_sub.add_parser("paper", help="all of the paper's single-machine experiments, with report and plots",
                             description="Run profile, decode-speedup, e2e, chunk-ablation and tile, then write "
                                         "DIR/report.md (our numbers beside the paper's), one PNG per figure and "
                                         "DIR/results.json.")
    add_setup_args(p)
    p.add_argument("--quick", action="store_true", help="a smaller plan that finishes in a few minutes")
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved runs of every configuration in every experiment (default: each experiment's "
                        "own, see `paper_plan`: 5 per batch timing and 3 per end-to-end run; --quick 3 and 2)")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_paper)


def _add_roofline(bench_sub) -> None:
    p = bench_sub.add_parser("roofline", help="peak matmul FLOP/s and memory bandwidth of this device, per dtype",
                             description="Measure (or read from the cache) the device's roofline: the best of several "
                                         "short trials, stored with the processor, its features, the thread count, "
                                         "the torch version and the dtype, and measured again when any of them "
                                         "changes or a later run observes a higher rate.")
    add_setup_args(p)
    p.add_argument("--sweep", action="store_true",
                   help="also time a LLaMA-7B-shaped matmul by batch rows, plain and packed GEMM")
    p.add_argument("--decode-stream", action="store_true",
                   help="also time one decode step's linear layers of SmolLM2-135M per GEMM backend")
    p.add_argument("--attention", action="store_true",
                   help="also time a prompt chunk's attention per backend (SDPA, the CPU kernels) at SmolLM2's and "
                        "LLaMA-7B's head shapes")
    p.add_argument("--decode-attention", action="store_true",
                   help="also time decode attention on a KV cache read from memory (the CPU kernels), at SmolLM2's "
                        "and LLaMA-7B's head shapes, beside the read bandwidth")
    p.add_argument("--rows", type=int, default=16, help="batch rows of --decode-stream's step (default 16)")
    p.add_argument("--repeats", type=int, default=5,
                   help="--decode-stream's, --attention's and --decode-attention's interleaved rounds, every "
                        "backend once per round (default 5)")
    p.set_defaults(func=cmd_roofline)
