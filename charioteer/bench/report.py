"""report.md and one PNG per figure for `charioteer bench paper`."""
from __future__ import annotations

import os

from charioteer.bench.stats import FASTER, SPREAD, cell

# The columns of the experiments' tables, in the report and on the command line alike (paper_cli).
DECODE_SPEEDUP_COLUMNS = ["seq_len", "batch_size", "decode_speedup", "verdict", "baseline_decode_ms_per_token",
                          "hybrid_decode_ms_per_token", "baseline_mfu", "hybrid_mfu"]
E2E_COLUMNS = ["policy", "chunk_size", "pd_ratio", "throughput_tok_s", "gain_vs_request_level", "vs_request_level",
               "gain_vs_orca_best", "vs_orca_best", "mfu", "roofline_gain", "mfu_ceiling", "piggybacked_decode_fraction"]
PEAK_COLUMNS = ["chunk_size", "balanced_pd", "peak_pd", "peak_gain", "peak_vs_request_level", "peak_within_30pct",
                "roofline_peak_pd"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def summarise(r: dict) -> dict:
    """The headline numbers, each beside the paper's, and the issue's acceptance checks (on verdicts,
    not on single samples: a gain whose spreads overlap does not count)."""
    s: dict = {}
    ds = r["decode_speedup"]["rows"]
    first_len = ds[0]["seq_len"]
    curve = [row for row in ds if row["seq_len"] == first_len]
    at2 = next((row for row in curve if row["batch_size"] == 2), None)
    s["decode_speedup_at_bs2"] = at2["decode_speedup"] if at2 else None
    s["decode_speedup_at_bs2_spread"] = at2["decode_speedup_spread"] if at2 else None
    s["decode_speedup_at_bs2_verdict"] = at2["verdict"] if at2 else None
    s["decode_speedup_at_max_bs"] = curve[-1]["decode_speedup"]
    s["decode_speedup_at_max_bs_spread"] = curve[-1]["decode_speedup_spread"]
    s["decode_speedup_at_max_bs_verdict"] = curve[-1]["verdict"]
    s["decode_speedup_seq_len"] = first_len
    s["decode_speedup_falls_with_batch"] = (
        s["decode_speedup_at_bs2"] is not None and s["decode_speedup_at_max_bs"] is not None
        and s["decode_speedup_at_max_bs"] < s["decode_speedup_at_bs2"])
    e2e = r["e2e"]
    balanced = []
    for c in e2e["chunk_sizes"]:
        pd = round(c / max(e2e["batch_size"] - 1, 1), 2)
        at = {row["policy"]: row for row in e2e["rows"] if row["pd_ratio"] == round(pd, 3)
              and (row["policy"] != "sarathi" or row["chunk_size"] == c)}
        mine = at.get("sarathi", {})
        balanced.append({"chunk_size": c, "pd_ratio": pd, "sarathi_gain": mine.get("gain_vs_request_level"),
                         "sarathi_gain_spread": mine.get("gain_vs_request_level_spread"),
                         "sarathi_vs_request_level": mine.get("vs_request_level"),
                         "sarathi_over_orca_best": mine.get("gain_vs_orca_best"),
                         "sarathi_over_orca_best_spread": mine.get("gain_vs_orca_best_spread"),
                         "sarathi_vs_orca_best": mine.get("vs_orca_best"),
                         "orca_best_gain": at.get("orca-best", {}).get("gain_vs_request_level"),
                         "orca_best_gain_spread": at.get("orca-best", {}).get("gain_vs_request_level_spread"),
                         "orca_worst_gain": at.get("orca-worst", {}).get("gain_vs_request_level"),
                         "orca_worst_gain_spread": at.get("orca-worst", {}).get("gain_vs_request_level_spread")})
    s["balanced"] = balanced
    s["sarathi_1.2x_and_above_orca_best"] = [
        b["chunk_size"] for b in balanced
        if b["sarathi_gain"] and b["sarathi_gain"] >= 1.2 and b["sarathi_vs_request_level"] == FASTER
        and b["sarathi_vs_orca_best"] == FASTER]
    s["peaks_within_30pct"] = [p["chunk_size"] for p in e2e["peaks"] if p["peak_within_30pct"]]
    s["tile_steps"] = [st["tokens"] for st in r["tile"]["steps"]]
    s["max_mfu"] = max_mfu(r)
    return s


def max_mfu(r: dict) -> float | None:
    """The largest MFU anywhere in the results, spreads included (never above 1)."""
    found = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k.endswith("mfu") and isinstance(v, (int, float)):
                    found.append(v)
                elif k.endswith("mfu_spread") and isinstance(v, list):
                    found.extend(e for e in v if isinstance(e, (int, float)))
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk({k: v for k, v in r.items() if k != "paper"})
    return max(found) if found else None


def write_report(r: dict, out: str) -> dict:
    s = summarise(r)
    plots = [_plot_figure3(r, out), _plot_decode_speedup(r, out), _plot_pd_sweep(r, out), _plot_breakdown(r, out),
             _plot_chunk_ablation(r, out), _plot_tile(r, out)]
    roof = r["roofline"]
    p = r["profile"]
    raised = (f" The peak was raised during the run from {roof['peak_raised_from_gflops']} GFLOP/s: a measured rate "
              "beat it, so it was measured again (a measured rate is a lower bound on the peak)."
              if roof.get("peak_raised_from_gflops") is not None else "")
    ident = roof.get("identity") or {}
    plan = r["plan"]
    dtype = roof.get("dtype", "float32")
    short = {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype)
    # A decode-only batch turns compute-bound at ridge x (weight bytes per parameter / 2 FLOP) tokens.
    bound_tokens = round(roof["ridge_flops_per_byte"] * (4 if dtype == "float32" else 2) / 2)
    gemms = ("Here the engine's fp32 matmuls (MKL packed GEMM up to 64 rows) are most efficient at 64 rows and step "
             "up just past 64 (Figure 7 below)" if dtype == "float32" else
             f"Here the engine's {short} matmuls step where Figure 7 below shows")
    lines = [
        "# SARATHI's single-machine experiments on Charioteer",
        "",
        f"Command: `charioteer bench paper{' --quick' if r['quick'] else ''}"
        f"{'' if dtype == 'float32' else ' --dtype ' + dtype} --out {out}`; wall time {r['wall_s']} s "
        "(" + ", ".join(f"{k} {r[k].get('wall_s')} s" for k in ("profile", "decode_speedup", "e2e", "chunk_ablation", "tile")
                        if isinstance(r.get(k), dict) and "wall_s" in r[k]) + ").",
        f"Model: {r['model']} ({r['layers']} layers, hidden {r['hidden_size']}), {short}, {r['device']}, "
        f"{r['threads']} threads.",
        f"Roofline: peak {short} matmul {roof['peak_matmul_gflops']} GFLOP/s, memory bandwidth "
        f"{roof['memory_bandwidth_gbs']} GB/s (ridge {roof['ridge_flops_per_byte']} FLOP/byte), best of "
        f"{roof.get('trials', '?')} short trials on {ident.get('processor', '?')} "
        f"[{' '.join(ident.get('features') or [])}], torch {ident.get('torch', '?')}.{raised} MFU below is model "
        f"FLOPs (linear layers, attention, LM head rows) over wall time over that peak; the largest anywhere here is "
        f"{s['max_mfu']}.",
        "",
        "Method: every configuration runs several times, interleaved (A B A B, not A A B B), "
        + ", ".join(f"{k} {v['repeats']}" for k, v in plan.items()) + " times. Each number is the median, and "
        "[min, max] beside it is the spread. Gains and speedups are ratios of medians; their spread is the range of "
        "ratios the two spreads allow. A verdict says \"faster\" or \"slower\" only when the two spreads do not "
        "overlap, otherwise \"not distinguishable\".",
        "",
        "Scale: the paper ran LLaMA-13B on an A6000, whose matmuls saturate at 256-512 tokens with 128-wide tiles. "
        f"{gemms}, and the ridge point is {roof['ridge_flops_per_byte']} FLOP/byte, so a decode-only batch of "
        f"~{bound_tokens} tokens is already compute-bound. "
        "Sequence lengths are "
        "the paper's / 4 (1K -> 256), the batch size is 16 (paper: 18 at 1K) and chunk sizes are 17, 33, 49, "
        "so that C + B - 1 = 32, 48, 64 rows (the paper's tile alignment).",
        "",
        "## Table 2: per-operation time",
        "",
        f"Sequence length {p['seq_len']}, batch size {p['batch_size']}; per-operation columns are medians. Paper "
        "(LLaMA-13B, A6000, 1K, batch 4): prefill-only 234.8 ms (0.229 ms/token, attention 4 %), decode-only "
        "49.96 ms (12.49 ms/token), hybrid 238.4 ms with decodes at 1.2 ms/token.",
        "",
        _md(p["table2"], ["batch", "prefill_tokens", "decodes", "preproj_ms", "attention_ms", "postproj_ms", "ffn_ms",
                          "other_ms", "total_ms", "ms_per_token", "mfu"]),
        "",
        f"Decode cost per token: {cell(p, 'decode_ms_per_token_alone')} ms in a decode-only batch, "
        f"{cell(p, 'decode_ms_per_token_in_hybrid')} ms piggybacked ({cell(p, 'decode_speedup_in_hybrid')}x, "
        f"{p['decode_speedup_in_hybrid_verdict']}; paper 10.4x).",
        "",
        "## Figure 3: decode over prefill cost per token",
        "",
        "Paper: 200x, 100x, 16.7x at batch 1, 2, 18.",
        "",
        _md(p["figure3"], ["batch_size", "prefill_ms_per_token", "decode_ms_per_token", "decode_over_prefill"]),
        "",
        "## Figure 8: decode speedup",
        "",
        f"Chunk size {r['decode_speedup']['chunk_size']}. Paper: above 10x at batch 2 and 2.8x at batch 18 (1K); "
        f"ours at batch 2: {cell(s, 'decode_speedup_at_bs2')}x ({s['decode_speedup_at_bs2_verdict']}), at batch "
        f"{r['decode_speedup']['rows'][-1]['batch_size']}: {cell(s, 'decode_speedup_at_max_bs')}x "
        f"({s['decode_speedup_at_max_bs_verdict']}) (L = {s['decode_speedup_seq_len']}). Verdict: a piggybacked "
        "decode against a decode alone.",
        "",
        _md(r["decode_speedup"]["rows"], DECODE_SPEEDUP_COLUMNS),
        "",
        "## Figures 9 and 11: end-to-end throughput",
        "",
        f"L = {r['e2e']['seq_len']}, B = {r['e2e']['batch_size']}, {r['e2e']['num_requests']} requests per run, all "
        "arriving at once. Gain is median throughput over request-level's at the same P:D (and, for sarathi, over "
        "Orca's best case). roofline_gain and mfu_ceiling: the same batches at the roofline's peak and bandwidth "
        "alone (`bench/ceiling.py`). Paper (1K, B = 18): sarathi peaks at 1.27x (C = 256, P:D 14), 1.23x (C = 512), 1.10x "
        "(C = 128); Orca best case 1.11x, worst case 1.0x.",
        "",
        _md(r["e2e"]["rows"], E2E_COLUMNS),
        "",
        "Peak P:D against C/(B-1):",
        "",
        _md(r["e2e"]["peaks"], PEAK_COLUMNS),
        "",
        "At the balanced points (Figure 11a):",
        "",
        _md(s["balanced"], ["chunk_size", "pd_ratio", "sarathi_gain", "sarathi_vs_request_level",
                            "sarathi_over_orca_best", "sarathi_vs_orca_best", "orca_best_gain", "orca_worst_gain"]),
        "",
        "## Figure 10: where the time goes at the balanced points",
        "",
        "Seconds over the whole run, medians of the runs.",
        "",
        _md([{"policy": x["policy"], "chunk_size": x["chunk_size"], "pd_ratio": x["pd_ratio"], **x["ops_s"],
              "total": x["elapsed_s"], "total_spread": x.get("elapsed_s_spread")}
             for x in r["e2e"]["rows"] if "ops_s" in x and x["policy"] in ("request-level", "sarathi")],
            ["policy", "chunk_size", "pd_ratio", "preproj", "attention", "postproj", "ffn", "other", "total"]),
        "",
        "## Figure 13: chunk size",
        "",
        f"Prompt of {r['chunk_ablation']['seq_len']} tokens; speedup is whole-prompt time over chunked time (whole "
        f"prompt {cell(r['chunk_ablation'], 'whole_prefill_ms')} ms). "
        "Paper (1K): attention 0.33/0.62/0.85/0.96, prefill 0.2/0.5/0.83/0.91 at C = 64/128/256/512; end-to-end "
        "1.0/1.16/1.27/1.20/1.24/1.23 at C = 64/128/256/320/384/512.",
        "",
        _md(r["chunk_ablation"]["rows"], ["chunk_size", "attention_speedup", "prefill_speedup", "prefill_speedup_verdict",
                                          "pd_ratio", "e2e_speedup", "e2e_verdict"]),
        "",
        "## Figure 7: tile quantization",
        "",
        f"Prefill iteration time from {r['tile']['points'][0]['tokens']} to {r['tile']['points'][-1]['tokens']} tokens "
        "in steps of 1, steps found on the medians. Paper (A6000): 256 -> 257 tokens costs 69.8 -> 92.3 ms (tile 128). "
        "Steps found here: "
        + (", ".join(f"{st['tokens']} tokens (+{st['jump']:.0%})" for st in r["tile"]["steps"]) or "none") + ".",
        "",
        "## Plots",
        "",
        "Error bars and bands are the spreads (min to max); an open end (\"inf\" in a table: a ratio over a "
        "time whose spread reaches zero) is drawn at twice the median.",
        "",
        *[f"![{os.path.basename(path)}]({os.path.basename(path)})" for path in plots if path],
        "",
    ]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines))
    return s


def _md(rows: list[dict], columns: list[str]) -> str:
    """A markdown table; a column with a spread prints as "median [min, max]"."""
    head = "| " + " | ".join(columns) + " |"
    body = ["| " + " | ".join(cell(row, c) for c in columns) + " |" for row in rows]
    return "\n".join([head, "|" + "---|" * len(columns), *body])


def _yerr(rows: list[dict], key: str):
    """matplotlib's yerr from each row's spread of `key` ([below, above] the median), None without spreads."""
    spreads = [row.get(key + SPREAD) for row in rows]
    if not all(spreads):
        return None
    # An unbounded end (a ratio over a time whose spread reaches 0) is drawn as twice the median.
    below = [max(0.0, row[key] - lo) if lo is not None else abs(row[key]) for row, (lo, _) in zip(rows, spreads)]
    above = [max(0.0, hi - row[key]) if hi is not None else abs(row[key]) for row, (_, hi) in zip(rows, spreads)]
    return [below, above]


def _save(fig, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _plot_figure3(r, out):
    plt = _plt()
    rows = r["profile"]["figure3"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(x["batch_size"]) for x in rows], [x["decode_over_prefill"] for x in rows],
           yerr=_yerr(rows, "decode_over_prefill"), capsize=3)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode / prefill cost per token")
    ax.set_title("Figure 3: decode vs prefill cost per token")
    return _save(fig, out, "figure3_decode_vs_prefill.png")


def _plot_decode_speedup(r, out):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    rows = r["decode_speedup"]["rows"]
    for seq_len in sorted({x["seq_len"] for x in rows}):
        pts = [x for x in rows if x["seq_len"] == seq_len and x["decode_speedup"] is not None]
        ax.errorbar([x["batch_size"] for x in pts], [x["decode_speedup"] for x in pts], yerr=_yerr(pts, "decode_speedup"),
                    fmt="o-", capsize=3, label=f"L={seq_len}")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode speedup")
    ax.set_title(f"Figure 8: decode speedup (C={r['decode_speedup']['chunk_size']})")
    ax.legend()
    return _save(fig, out, "figure8_decode_speedup.png")


def _plot_pd_sweep(r, out):
    plt = _plt()
    e2e = r["e2e"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    series = [("sarathi", c) for c in e2e["chunk_sizes"]] + [("orca-best", None), ("orca-worst", None)]
    for policy, c in series:
        pts = sorted((x for x in e2e["rows"] if x["policy"] == policy and x["chunk_size"] == c
                      and x.get("gain_vs_request_level")), key=lambda x: x["pd_ratio"])
        if pts:
            label = f"sarathi C={c}" if c else policy
            ax.errorbar([x["pd_ratio"] for x in pts], [x["gain_vs_request_level"] for x in pts],
                        yerr=_yerr(pts, "gain_vs_request_level"), fmt="o-", capsize=3, label=label)
    for c in e2e["chunk_sizes"]:
        ax.axvline(c / max(e2e["batch_size"] - 1, 1), color="grey", ls=":", lw=0.8)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("P:D ratio (dotted: C/(B-1))")
    ax.set_ylabel("throughput / request-level")
    ax.set_title(f"Figures 9, 11: L={e2e['seq_len']}, B={e2e['batch_size']}")
    ax.legend(fontsize=8)
    return _save(fig, out, "figure9_11_pd_sweep.png")


def _plot_breakdown(r, out):
    rows = [x for x in r["e2e"]["rows"] if "ops_s" in x and x["policy"] in ("request-level", "sarathi")]
    if not rows:
        return None
    plt = _plt()
    ops = ["preproj", "attention", "postproj", "ffn", "other"]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{x['policy'][:7]}{'' if x['chunk_size'] is None else ' C=' + str(x['chunk_size'])}\nP:D {x['pd_ratio']}"
              for x in rows]
    bottom = [0.0] * len(rows)
    for op in ops:
        vals = [x["ops_s"][op] for x in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, label=op)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title("Figure 10: time per operation at balanced P:D")
    ax.legend(fontsize=8)
    return _save(fig, out, "figure10_breakdown.png")


def _plot_chunk_ablation(r, out):
    plt = _plt()
    rows = r["chunk_ablation"]["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    cs = [x["chunk_size"] for x in rows]
    for key, label in (("attention_speedup", "prefill attention (13a)"), ("prefill_speedup", "prefill total (13b)"),
                       ("e2e_speedup", "end-to-end (13c)")):
        if all(x.get(key) is not None for x in rows):
            ax.errorbar(cs, [x[key] for x in rows], yerr=_yerr(rows, key), fmt="o-", capsize=3, label=label)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("chunk size")
    ax.set_ylabel("speedup over whole prompt / baseline")
    ax.set_title(f"Figure 13: chunk size, L={r['chunk_ablation']['seq_len']}")
    ax.legend(fontsize=8)
    return _save(fig, out, "figure13_chunk_ablation.png")


def _plot_tile(r, out):
    plt = _plt()
    pts = r["tile"]["points"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.plot([x["tokens"] for x in pts], [x["ms"] for x in pts], ".-")
    if all(x.get("ms" + SPREAD) for x in pts):
        ax.fill_between([x["tokens"] for x in pts], [x["ms" + SPREAD][0] for x in pts],
                        [x["ms" + SPREAD][1] for x in pts], alpha=0.3, lw=0)
    for st in r["tile"]["steps"]:
        ax.axvline(st["tokens"], color="red", ls=":", lw=0.8)
    ax.set_xlabel("tokens in the batch")
    ax.set_ylabel("iteration time (ms)")
    ax.set_title("Figure 7: iteration time by token count (red: steps)")
    return _save(fig, out, "figure7_tile.png")

