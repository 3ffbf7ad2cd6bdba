"""`charioteer profile` and `charioteer bench decode-speedup|e2e|chunk-ablation|tile|paper|roofline`.

Wire with `add_profile_parser(sub)` and `add_paper_benches(bench_sub)`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from charioteer.bench import experiments as ex
from charioteer.bench.e2e import POLICIES


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("setup")
    g.add_argument("--model", default=None,
                   help=f"model to measure (default: {ex.DEFAULT_BENCH_MODEL}, one LLaMA-7B layer); "
                        "any --model of `charioteer generate`, e.g. smollm2-135m")
    g.add_argument("--num-layers", type=int, default=None, help="keep only the first N layers")
    g.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    g.add_argument("--refresh-roofline", action="store_true", help="measure the roofline again instead of the cached one")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _start(args) -> dict:
    import torch

    from charioteer.bench.roofline import describe, roofline

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda given but torch sees no CUDA device here; use --device cpu")
    roof = roofline(args.device, refresh=args.refresh_roofline)
    print(describe(roof), file=sys.stderr)
    return roof


def _setup(args, roof: dict, max_cached_tokens: int = 32768) -> ex.Setup:
    setup = ex.make_setup(args.model, args.device, roof, args.num_layers, max_cached_tokens)
    c = setup.model.config
    print(f"model: {c.name}, {c.num_layers} layers, hidden {c.hidden_size}, ffn {c.intermediate_size}, "
          f"vocab {c.vocab_size}, {args.device}, {ex.threads()} threads", file=sys.stderr)
    return setup


@contextlib.contextmanager
def _progress(total: int, desc: str):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)
    try:
        yield bar
    finally:
        bar.close()


def _meta(args, setup: ex.Setup, roof: dict) -> dict:
    c = setup.model.config
    return {"model": c.name, "layers": c.num_layers, "hidden_size": c.hidden_size, "device": args.device,
            "threads": ex.threads(), "roofline": roof}


def format_table(rows: list[dict], columns: list[str]) -> str:
    cells = [[_fmt(r.get(col)) for col in columns] for r in rows]
    widths = [max(len(col), *(len(row[i]) for row in cells)) for i, col in enumerate(columns)]
    lines = ["  ".join(col.rjust(w) for col, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def _emit(args, result: dict, text: str) -> None:
    print(json.dumps(result) if args.json else text)


# ---- commands ---------------------------------------------------------------------------


def cmd_profile(args) -> int:
    roof = _start(args)
    setup = _setup(args, roof)
    with _progress(ex.profile_steps(args.fig3_batch_sizes), "profile") as bar:
        result = ex.profile(setup, args.seq_len, args.batch_size, tuple(args.fig3_batch_sizes), args.repeats, bar)
    result.update(_meta(args, setup, roof))
    cols = ["batch", "prefill_tokens", "decodes", "preproj_ms", "attention_ms", "postproj_ms", "ffn_ms",
            "other_ms", "total_ms", "ms_per_token", "mfu"]
    text = (f"Table 2: per-operation time, sequence length {args.seq_len}, batch size {args.batch_size}\n"
            f"{format_table(result['table2'], cols)}\n"
            f"decode cost per token: {result['decode_ms_per_token_alone']} ms alone, "
            f"{result['decode_ms_per_token_in_hybrid']} ms piggybacked in the hybrid batch "
            f"({result['decode_speedup_in_hybrid']}x; paper: 12.49 -> 1.2 ms, 10.4x)\n\n"
            f"Figure 3: decode over prefill cost per token (paper, one LLaMA-13B layer on A6000, 1K: "
            f"200x, 100x, 16.7x at batch 1, 2, 18)\n"
            f"{format_table(result['figure3'], ['batch_size', 'prefill_ms_per_token', 'decode_ms_per_token', 'decode_over_prefill'])}")
    _emit(args, result, text)
    return 0


def cmd_decode_speedup(args) -> int:
    roof = _start(args)
    setup = _setup(args, roof, max_cached_tokens=max(args.seq_lens) * max(args.batch_sizes) + args.chunk_size)
    with _progress(len(args.seq_lens) * len(args.batch_sizes), "decode-speedup") as bar:
        result = ex.decode_speedup(setup, tuple(args.seq_lens), tuple(args.batch_sizes), args.chunk_size, args.repeats, bar)
    result.update(_meta(args, setup, roof))
    cols = ["seq_len", "batch_size", "decode_speedup", "baseline_decode_ms_per_token", "hybrid_decode_ms_per_token",
            "baseline_mfu", "hybrid_mfu"]
    _emit(args, result, f"Figure 8: decode speedup, chunk size {args.chunk_size} (paper: >10x at batch 2, "
                        f"2.8x at batch 18, 1K)\n{format_table(result['rows'], cols)}")
    return 0


def cmd_e2e(args) -> int:
    roof = _start(args)
    setup = _setup(args, roof)
    steps = ex.e2e_steps(args.chunk_sizes, args.pd_ratios, args.batch_size, args.policies)
    with _progress(steps, "e2e runs") as bar:
        result = ex.e2e(setup, tuple(args.chunk_sizes), tuple(args.pd_ratios), args.batch_size, args.seq_len,
                        args.num_requests, tuple(args.policies), bar)
    result.update(_meta(args, setup, roof))
    _emit(args, result, format_e2e(result))
    return 0


def format_e2e(result: dict) -> str:
    cols = ["policy", "chunk_size", "pd_ratio", "prompt_len", "decode_len", "throughput_tok_s",
            "gain_vs_request_level", "mfu", "piggybacked_decode_fraction", "decode_only_batches"]
    lines = [f"Figures 9, 11: end-to-end throughput, L = {result['seq_len']}, B = {result['batch_size']}, "
             f"{result['num_requests']} requests (paper, 1K, B = 18: sarathi C=256 peaks at 1.27x near P:D 14; "
             f"Orca best case 1.11x, worst case 1.0x)", format_table(result["rows"], cols), "",
             "P:D of the peak against the balanced point C/(B-1):",
             format_table(result["peaks"], ["chunk_size", "balanced_pd", "peak_pd", "peak_gain", "peak_within_30pct"])]
    breakdown = [r for r in result["rows"] if "ops_s" in r and r["policy"] in ("request-level", "sarathi")]
    if breakdown:
        lines += ["", "Figure 10: seconds per operation over the whole run, at the balanced P:D points"]
        lines.append(format_table([{"policy": r["policy"], "chunk_size": r["chunk_size"], "pd_ratio": r["pd_ratio"],
                                    **r["ops_s"], "total": r["elapsed_s"]} for r in breakdown],
                                  ["policy", "chunk_size", "pd_ratio", "preproj", "attention", "postproj", "ffn", "other", "total"]))
    return "\n".join(lines)


def cmd_chunk_ablation(args) -> int:
    roof = _start(args)
    setup = _setup(args, roof)
    with _progress(len(args.chunk_sizes), "chunk sizes") as bar:
        result = ex.chunk_ablation(setup, args.seq_len, tuple(args.chunk_sizes), args.batch_size, args.num_requests,
                                   args.repeats, not args.no_e2e, bar)
    result.update(_meta(args, setup, roof))
    cols = ["chunk_size", "prefill_attention_ms", "attention_speedup", "prefill_total_ms", "prefill_speedup",
            "pd_ratio", "e2e_speedup"]
    _emit(args, result, f"Figure 13: chunk-size ablation, prompt of {args.seq_len} tokens (whole prompt: "
                        f"{result['whole_prefill_ms']} ms, attention {result['whole_prefill_attention_ms']} ms)\n"
                        f"{format_table(result['rows'], cols)}")
    return 0


def cmd_tile(args) -> int:
    roof = _start(args)
    setup = _setup(args, roof)
    with _progress(ex.tile_steps(args.start, args.stop), "tokens") as bar:
        result = ex.tile_sweep(setup, args.start, args.stop, args.repeats, args.threshold, bar)
    result.update(_meta(args, setup, roof))
    steps = result["steps"]
    text = "\n".join([
        f"Figure 7: prefill iteration time, {args.start}..{args.stop} tokens in steps of 1 (paper, A6000: "
        f"256 -> 257 tokens takes 69.8 -> 92.3 ms, tile 128)",
        format_table(result["points"], ["tokens", "ms", "gflops"]),
        "steps found: " + (", ".join(f"{s['tokens']} tokens (+{s['jump']:.0%})" for s in steps) if steps else "none"),
    ])
    _emit(args, result, text)
    return 0


def cmd_roofline(args) -> int:
    from charioteer.bench.roofline import matmul_sweep

    roof = _start(args)
    text = json.dumps(roof, indent=2)
    if args.sweep:
        roof = {**roof, "matmul_sweep": matmul_sweep(args.device)}
        text += ("\nfp32 GFLOP/s of a 22016 x 4096 weight (LLaMA-7B gate/up) by batch rows:\n"
                 + format_table(roof["matmul_sweep"], ["rows", "linear_gflops", "packed_gflops", "panel_gflops"]))
    if args.decode_stream:
        from charioteer.bench.roofline import decode_gemm_stream

        if args.rows < 1:
            raise SystemExit(f"--rows must be at least 1, got {args.rows}")
        roof = {**roof, "decode_gemm_stream": decode_gemm_stream(args.device, rows=args.rows)}
        text += (f"\nOne {args.rows}-row decode step's linear layers of SmolLM2-135M (weights streamed from memory):\n"
                 + format_table(roof["decode_gemm_stream"],
                                ["backend", "ms", "weight_gbs", "gflops", "weight_mb", "lm_head_ms", "lm_head_gbs"]))
    _emit(args, roof, text)
    return 0


def cmd_paper(args) -> int:
    from charioteer.bench.report import write_report

    roof = _start(args)
    setup = _setup(args, roof)
    plan = ex.paper_plan(args.quick)
    os.makedirs(args.out, exist_ok=True)
    results: dict = {"quick": args.quick, "plan": plan}
    started = time.perf_counter()
    total = (ex.profile_steps(plan["profile"]["fig3_batch_sizes"])
             + len(plan["decode_speedup"]["seq_lens"]) * len(plan["decode_speedup"]["batch_sizes"])
             + ex.e2e_steps(plan["e2e"]["chunk_sizes"], plan["e2e"]["pd_ratios"], plan["e2e"]["batch_size"], POLICIES)
             + len(plan["chunk_ablation"]["chunk_sizes"])
             + ex.tile_steps(plan["tile"]["start"], plan["tile"]["stop"]))
    with _progress(total, "paper") as bar:
        results["profile"] = ex.profile(setup, **plan["profile"], progress=bar)
        results["decode_speedup"] = ex.decode_speedup(setup, **plan["decode_speedup"], progress=bar)
        results["e2e"] = ex.e2e(setup, **plan["e2e"], progress=bar)
        results["chunk_ablation"] = ex.chunk_ablation(setup, **plan["chunk_ablation"], progress=bar)
        results["tile"] = ex.tile_sweep(setup, **plan["tile"], progress=bar)
    results.update(_meta(args, setup, roof))
    results["paper"] = ex.PAPER  # the paper's numbers, for comparison
    results["wall_s"] = round(time.perf_counter() - started, 1)
    summary = write_report(results, args.out)
    results["summary"] = summary
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    _emit(args, {"out": args.out, "summary": summary, "wall_s": results["wall_s"]},
          f"wrote {args.out}/report.md, results.json and plots in {results['wall_s']} s\n"
          + json.dumps(summary, indent=2))
    return 0


# ---- parsers ----------------------------------------------------------------------------


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="per-operation times of prefill, decode and hybrid batches (Table 2, Figure 3)",
                       description="Time each operation (preproj, attention, postproj, ffn, other) of a prefill-only, "
                                   "a decode-only and a hybrid batch on the real model: the paper's Table 2. Also "
                                   "prints decode over prefill cost per token by batch size (Figure 3).")
    _add_common(p)
    p.add_argument("--seq-len", type=int, default=256, help="sequence length L (default: 256; the paper's 1K / 4)")
    p.add_argument("--batch-size", type=int, default=4, help="batch size of Table 2 (default: 4, as the paper)")
    p.add_argument("--fig3-batch-sizes", type=_ints, default=[1, 2, 16],
                   help="Figure 3 batch sizes, the last being the maximum (default: 1,2,16)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per batch; the median is reported (default: 5)")
    p.set_defaults(func=cmd_profile)


def add_paper_benches(bench_sub) -> None:
    p = bench_sub.add_parser("decode-speedup", help="decode speedup of piggybacked decodes by batch size (Figure 8)",
                             description="Baseline decode-only time per token over the marginal time per decode "
                                         "piggybacked on a prompt chunk, by batch size and sequence length.")
    _add_common(p)
    p.add_argument("--seq-lens", type=_ints, default=[256, 512, 768], help="context lengths (default: 256,512,768)")
    p.add_argument("--batch-sizes", type=_ints, default=[2, 4, 8, 12, 16], help="batch sizes >= 2 (default: 2,4,8,12,16)")
    p.add_argument("--chunk-size", type=int, default=32,
                   help="prompt chunk of the hybrid batch (default: 32, so chunk + 15 decodes stays within 64 rows)")
    p.add_argument("--repeats", type=int, default=7, help="alternating timed runs per point (default: 7)")
    p.set_defaults(func=cmd_decode_speedup)

    p = bench_sub.add_parser("e2e", help="end-to-end throughput over P:D and chunk size (Figures 9, 10, 11)",
                             description="Run the paper's workload (all requests of length L at one P:D ratio, batch "
                                         "size B) to completion under each policy and chunk size.")
    _add_common(p)
    p.add_argument("--chunk-sizes", type=_ints, default=[17, 33, 49],
                   help="sarathi chunk sizes (default: 17,33,49: C + B - 1 = 32, 48, 64 rows)")
    p.add_argument("--pd-ratios", type=_floats, default=[0.5, 1, 2, 4, 8, 16],
                   help="P:D ratios; each chunk size's balanced C/(B-1) is added (default: 0.5,1,2,4,8,16)")
    p.add_argument("--batch-size", type=int, default=16, help="batch size B (default: 16)")
    p.add_argument("--seq-len", type=int, default=256, help="sequence length L = P + D (default: 256)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per run (default: 64)")
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES),
                   help=f"comma-separated, from {','.join(POLICIES)} (default: all)")
    p.set_defaults(func=cmd_e2e)

    p = bench_sub.add_parser("chunk-ablation", help="prefill attention, prefill and e2e time by chunk size (Figure 13)",
                             description="Chunked against whole-prompt prefill time (attention and total), and "
                                         "end-to-end throughput at each chunk size's balanced P:D against request-level.")
    _add_common(p)
    p.add_argument("--seq-len", type=int, default=256, help="prompt / sequence length (default: 256)")
    p.add_argument("--chunk-sizes", type=_ints, default=[17, 33, 49, 64, 96, 128],
                   help="chunk sizes (default: 17,33,49,64,96,128)")
    p.add_argument("--batch-size", type=int, default=16, help="batch size B for the e2e part (default: 16)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per e2e run (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per chunk batch (default: 3)")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end part (Figure 13c)")
    p.set_defaults(func=cmd_chunk_ablation)

    p = bench_sub.add_parser("tile", help="iteration time by token count in steps of 1 (Figure 7)",
                             description="Time a prefill of n tokens for every n in [start, stop] and report any step "
                                         "(tile or wave quantization) in the curve.")
    _add_common(p)
    p.add_argument("--start", type=int, default=1, help="first token count (default: 1)")
    p.add_argument("--stop", type=int, default=160, help="last token count (default: 160)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (default: 3)")
    p.add_argument("--threshold", type=float, default=0.08, help="relative jump that counts as a step (default: 0.08)")
    p.set_defaults(func=cmd_tile)

    p = bench_sub.add_parser("paper", help="all of the paper's single-machine experiments, with report and plots",
                             description="Run profile, decode-speedup, e2e, chunk-ablation and tile, then write "
                                         "DIR/report.md (our numbers beside the paper's), one PNG per figure and "
                                         "DIR/results.json.")
    _add_common(p)
    p.add_argument("--quick", action="store_true", help="a smaller plan that finishes in a few minutes")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_paper)

    p = bench_sub.add_parser("roofline", help="peak fp32 matmul FLOP/s and memory bandwidth of this device",
                             description="Measure (or read from the cache) the device's roofline.")
    _add_common(p)
    p.add_argument("--sweep", action="store_true",
                   help="also time a LLaMA-7B-shaped matmul by batch rows, plain and packed GEMM")
    p.add_argument("--decode-stream", action="store_true",
                   help="also time one decode step's linear layers of SmolLM2-135M per GEMM backend")
    p.add_argument("--rows", type=int, default=16, help="batch rows of --decode-stream's step (default 16)")
    p.set_defaults(func=cmd_roofline)
