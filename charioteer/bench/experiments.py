"""The paper's single-machine experiments (section 5) as functions that return plain dicts.

Each takes a `Setup` (the model, its BatchTimer, the roofline) and the experiment's knobs, and
reports numbers measured on the real engine. `charioteer profile` and `charioteer bench ...`
print them; `charioteer bench paper` gathers them into a report.

Scale: on a GPU the paper's chunks are 256-512 tokens, because that is where a GPU's matmuls
saturate and its tiles are 128 wide. Here the engine's fp32 matmuls (MKL packed GEMM) are most
efficient at 64 rows and step up in time just past 64 (`charioteer bench tile`), and decode-only
batches are less memory-bound than on a GPU (the ridge point is ~11 FLOP/byte, ~22 fp32 tokens).
So the defaults use sequences of 256 (the paper's 1K / 4), batch size 16 (the paper's 18 at 1K)
and chunk sizes 17, 33 and 49, which fill a batch to 32, 48 and 64 rows (C + B - 1), the
paper's tile alignment.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from charioteer.bench.batch_timer import BatchShape, BatchTimer
from charioteer.bench.e2e import POLICIES, Workload, balanced_pd, pd_grid, run_e2e
from charioteer.model.config import ModelConfig
from charioteer.model.llama import LlamaModel
from charioteer.model.loader import LoadedModel, load_model

# A LLaMA-7B layer: linear layers dominate as in the paper. One layer keeps runs short; the
# vocabulary is cut to 1000 per layer (32000 / 32 layers) so the LM head weighs what it does
# in the whole 32-layer model.
DEFAULT_BENCH_MODEL = "synthetic:llama-7b,layers=1,vocab=1000"

# The paper's numbers (LLaMA-13B on A6000 unless noted), for the report.
PAPER = {
    "table2": {"prefill_ms_per_token": 0.229, "decode_ms_per_token": 12.49, "hybrid_decode_ms_per_token": 1.2,
               "prefill_total_ms": 234.8, "decode_total_ms": 49.96, "hybrid_total_ms": 238.4,
               "prefill_attention_share": 10 / 234.8, "hybrid_attention_share": 15.2 / 238.4},
    "figure3": {1: 200.0, 2: 100.0, 18: 16.7},  # decode/prefill cost per token at batch size 1, 2, max
    "figure8": {"seq_1k_bs2": 10.0, "seq_1k_bs18": 2.8},
    "figure9": {"peak_gain_c256": 1.27, "peak_gain_c512": 1.23, "peak_gain_c128": 1.10},
    "figure11a": {"sarathi": 1.27, "orca-best": 1.11, "orca-worst": 1.0},
    "figure13a": {64: 0.33, 128: 0.62, 256: 0.85, 512: 0.96},  # prefill attention speedup vs whole prompt
    "figure13b": {64: 0.2, 128: 0.5, 256: 0.83, 512: 0.91},  # total prefill speedup
    "figure13c": {64: 1.0, 128: 1.16, 256: 1.27, 320: 1.20, 384: 1.24, 512: 1.23},  # e2e vs baseline
    "figure7": {"tokens_256_ms": 69.8, "tokens_257_ms": 92.33, "tile": 128},
}


@dataclass
class Setup:
    loaded: LoadedModel
    model: LlamaModel
    timer: BatchTimer
    device: str
    roofline: dict

    @property
    def peak_flops(self) -> float:
        return self.roofline["peak_matmul_gflops"] * 1e9


def make_setup(model: str | None, device: str, roofline: dict, num_layers: int | None = None,
               max_cached_tokens: int = 32768) -> Setup:
    loaded = load_model(model or DEFAULT_BENCH_MODEL, num_layers=num_layers)
    llama = LlamaModel(loaded.config, loaded.state_dict, device)
    return Setup(loaded, llama, BatchTimer(llama, max_cached_tokens), device, roofline)


def _mfu(setup: Setup, shape: BatchShape, seconds: float) -> float:
    return shape.flops(setup.model.config) / seconds / setup.peak_flops


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


# ---- Table 2 and Figure 3 ----------------------------------------------------------------


def profile(setup: Setup, seq_len: int = 256, batch_size: int = 4, fig3_batch_sizes=(1, 2, 16),
            repeats: int = 5, progress=None) -> dict:
    """Per-operation times of prefill-only, decode-only and hybrid batches (Table 2), and Figure 3."""
    if batch_size < 2 or seq_len <= batch_size:
        raise ValueError(f"profile needs batch_size >= 2 and seq_len > batch_size, got {batch_size}, {seq_len}")
    chunk = seq_len - (batch_size - 1)
    shapes = {
        "prefill-only": BatchShape(prefills=((seq_len, 0),) * batch_size),
        "decode-only": BatchShape(decodes=(seq_len,) * batch_size),
        "hybrid": BatchShape(prefills=((chunk, 0),), decodes=(seq_len,) * (batch_size - 1)),
        "hybrid's chunk alone": BatchShape(prefills=((chunk, 0),)),
    }
    timings = {}
    for kind, shape in shapes.items():
        timings[kind] = setup.timer.time(shape, repeats=repeats)
        if progress:
            progress.update()
    rows = []
    for kind, t in timings.items():
        shape = t.shape
        rows.append({
            "batch": kind, "prefill_tokens": shape.num_prefill_tokens, "decodes": len(shape.decodes),
            **{f"{op}_ms": _ms(s) for op, s in t.ops_s.items()}, "total_ms": _ms(t.total_s),
            "ms_per_token": _ms(t.total_s / shape.num_tokens), "mfu": round(_mfu(setup, shape, t.total_s), 3),
        })
    marginal = (timings["hybrid"].total_s - timings["hybrid's chunk alone"].total_s) / (batch_size - 1)
    decode_alone = timings["decode-only"].total_s / batch_size
    figure3 = []
    for b in fig3_batch_sizes:
        pre = setup.timer.time(BatchShape(prefills=((seq_len, 0),) * b), repeats=repeats)
        dec = setup.timer.time(BatchShape(decodes=(seq_len,) * b), repeats=repeats)
        if progress:
            progress.update()
        p, d = pre.total_s / (b * seq_len), dec.total_s / b
        figure3.append({"batch_size": b, "prefill_ms_per_token": _ms(p), "decode_ms_per_token": _ms(d),
                        "decode_over_prefill": round(d / p, 1)})
    return {
        "seq_len": seq_len, "batch_size": batch_size, "table2": rows,
        "decode_ms_per_token_alone": _ms(decode_alone),
        "decode_ms_per_token_in_hybrid": _ms(marginal),
        "decode_speedup_in_hybrid": round(decode_alone / marginal, 2) if marginal > 0 else None,
        "figure3": figure3,
    }


def profile_steps(fig3_batch_sizes) -> int:
    return 4 + len(fig3_batch_sizes)


# ---- Figure 8: decode speedup ------------------------------------------------------------


def decode_speedup(setup: Setup, seq_lens=(256, 512, 768), batch_sizes=(2, 4, 8, 12, 16), chunk_size: int = 32,
                   repeats: int = 7, progress=None) -> dict:
    """Baseline decode time per token over the marginal decode time per token in a hybrid batch.

    Marginal = (hybrid batch - the same chunk alone) / decodes, both timed alternately so the
    difference is not swamped by drift. Batch size b means 1 chunk + (b - 1) decodes in the
    hybrid batch and b decodes in the baseline's decode-only batch.
    """
    rows = []
    for seq_len in seq_lens:
        for b in batch_sizes:
            if b < 2:
                raise ValueError(f"decode speedup needs batch sizes >= 2 (one chunk plus decodes), got {b}")
            chunk = BatchShape(prefills=((chunk_size, 0),), prefills_sample=False)
            hybrid = BatchShape(prefills=((chunk_size, 0),), decodes=(seq_len,) * (b - 1), prefills_sample=False)
            t_hybrid, t_chunk, diff = setup.timer.time_pair(hybrid, chunk, repeats=repeats)
            baseline = setup.timer.time(BatchShape(decodes=(seq_len,) * b), repeats=repeats)
            per_token = baseline.total_s / b
            marginal = diff / (b - 1)
            rows.append({
                "seq_len": seq_len, "batch_size": b, "chunk_size": chunk_size,
                "decode_speedup": round(per_token / marginal, 2) if marginal > 0 else None,
                "baseline_decode_ms_per_token": _ms(per_token), "hybrid_decode_ms_per_token": _ms(marginal),
                "hybrid_batch_ms": _ms(t_hybrid.total_s), "chunk_alone_ms": _ms(t_chunk.total_s),
                "baseline_batch_ms": _ms(baseline.total_s),
                "baseline_mfu": round(_mfu(setup, baseline.shape, baseline.total_s), 3),
                "hybrid_mfu": round(_mfu(setup, hybrid, t_hybrid.total_s), 3),
            })
            if progress:
                progress.update()
    return {"chunk_size": chunk_size, "rows": rows}


# ---- Figures 9, 10, 11: end-to-end throughput ----------------------------------------------


def e2e(setup: Setup, chunk_sizes=(17, 33, 49), pd_ratios=(0.5, 1, 2, 4, 8, 16), batch_size: int = 16,
        seq_len: int = 256, num_requests: int = 64, policies=POLICIES, progress=None) -> dict:
    """P:D sweep (Figures 9, 11b), per-operation breakdown at the balanced point (Figure 10)."""
    grid = pd_grid(list(chunk_sizes), batch_size, list(pd_ratios))
    rows = []
    for pd in grid:
        workload = Workload(seq_len, pd, num_requests)
        baseline = None
        balanced = any(math.isclose(pd, round(balanced_pd(c, batch_size), 2)) for c in chunk_sizes)
        for policy in policies:
            if policy == "orca-worst" and not balanced and len(grid) > 1:
                continue  # it matches request-level by construction; Figure 11a needs it at the balanced points
            for c in (chunk_sizes if policy == "sarathi" else chunk_sizes[:1]):
                breakdown = balanced  # Figure 10 needs the per-operation breakdown only there
                row = run_e2e(setup.loaded, policy, c, batch_size, workload, setup.device, op_breakdown=breakdown)
                row["mfu"] = round(workload_flops(setup, workload) / row["elapsed_s"] / setup.peak_flops, 3)
                row["balanced_pd"] = round(balanced_pd(c, batch_size), 2) if policy == "sarathi" else None
                rows.append(row)
                if policy == "request-level":
                    baseline = row
                if progress:
                    progress.update()
        for row in rows:
            if row["pd_ratio"] == round(pd, 3):
                row["gain_vs_request_level"] = (
                    round(row["throughput_tok_s"] / baseline["throughput_tok_s"], 3) if baseline else None)
    peaks = []
    for c in chunk_sizes:
        mine = [r for r in rows if r["policy"] == "sarathi" and r["chunk_size"] == c and r.get("gain_vs_request_level")]
        if mine:
            best = max(mine, key=lambda r: r["gain_vs_request_level"])
            target = balanced_pd(c, batch_size)
            peaks.append({"chunk_size": c, "balanced_pd": round(target, 2), "peak_pd": best["pd_ratio"],
                          "peak_gain": best["gain_vs_request_level"],
                          "peak_within_30pct": abs(best["pd_ratio"] - target) <= 0.3 * target})
    return {"batch_size": batch_size, "seq_len": seq_len, "num_requests": num_requests,
            "chunk_sizes": list(chunk_sizes), "pd_ratios": grid, "rows": rows, "peaks": peaks}


def e2e_steps(chunk_sizes, pd_ratios, batch_size, policies) -> int:
    grid = pd_grid(list(chunk_sizes), batch_size, list(pd_ratios))
    per_pd = sum(len(chunk_sizes) if p == "sarathi" else 1 for p in policies if p != "orca-worst")
    worst = 0 if "orca-worst" not in policies else len(grid) if len(grid) == 1 else len(
        {round(balanced_pd(c, batch_size), 2) for c in chunk_sizes})
    return per_pd * len(grid) + worst


def request_flops(c: ModelConfig, prompt_len: int, decode_len: int) -> float:
    """Model FLOPs of one request: linear layers for every token, causal attention, an LM head row per output."""
    per_key = 4 * c.q_size * c.num_layers  # QK^T and AV, per query-key pair
    length = prompt_len + decode_len
    attention = per_key * (prompt_len * (prompt_len + 1) / 2 + sum(range(prompt_len + 1, length + 1)))
    return c.linear_flops_per_token() * length + attention + 2 * c.hidden_size * c.vocab_size * decode_len


def workload_flops(setup: Setup, workload: Workload) -> float:
    """Model FLOPs of a whole e2e run."""
    return workload.num_requests * request_flops(setup.model.config, workload.prompt_len, workload.decode_len)


# ---- Figure 13: chunk-size ablation --------------------------------------------------------


def chunk_ablation(setup: Setup, seq_len: int = 256, chunk_sizes=(17, 33, 49, 64, 96, 128), batch_size: int = 16,
                   num_requests: int = 64, repeats: int = 3, with_e2e: bool = True, progress=None) -> dict:
    """Prefill attention time and total prefill time of a chunked prompt against the whole prompt
    (Figure 13a, b), and end-to-end throughput at each chunk's balanced P:D (Figure 13c)."""
    whole = setup.timer.time(BatchShape(prefills=((seq_len, 0),)), repeats=repeats)
    rows = []
    for c in chunk_sizes:
        attention = total = 0.0
        for start in range(0, seq_len, c):
            n = min(c, seq_len - start)
            t = setup.timer.time(BatchShape(prefills=((n, start),), prefills_sample=start + n == seq_len), repeats=repeats)
            attention += t.ops_s["attention"]
            total += t.total_s
        row = {"chunk_size": c, "prefill_attention_ms": _ms(attention), "prefill_total_ms": _ms(total),
               "attention_speedup": round(whole.ops_s["attention"] / attention, 3),
               "prefill_speedup": round(whole.total_s / total, 3)}
        if with_e2e:
            workload = Workload(seq_len, balanced_pd(c, batch_size), num_requests)
            base = run_e2e(setup.loaded, "request-level", c, batch_size, workload, setup.device)
            mine = run_e2e(setup.loaded, "sarathi", c, batch_size, workload, setup.device)
            row.update({"pd_ratio": round(workload.pd_ratio, 2), "sarathi_tok_s": mine["throughput_tok_s"],
                        "request_level_tok_s": base["throughput_tok_s"],
                        "e2e_speedup": round(mine["throughput_tok_s"] / base["throughput_tok_s"], 3)})
        rows.append(row)
        if progress:
            progress.update()
    return {"seq_len": seq_len, "batch_size": batch_size, "whole_prefill_ms": _ms(whole.total_s),
            "whole_prefill_attention_ms": _ms(whole.ops_s["attention"]), "rows": rows}


# ---- Figure 7: tile quantization -----------------------------------------------------------


def tile_sweep(setup: Setup, start: int = 1, stop: int = 160, repeats: int = 3, threshold: float = 0.08,
               progress=None) -> dict:
    """Iteration time of a prefill of n tokens, n = start..stop in steps of 1; report any step.

    A step is an n where the time jumps by more than `threshold` (relative) over n - 1, while
    adding a token costs only ~1/n more work, and the next points stay up (a real step, not noise).
    """
    points = []
    for n in range(start, stop + 1):
        shape = BatchShape(prefills=((n, 0),), prefills_sample=False)
        t = setup.timer.time(shape, repeats=repeats)
        points.append({"tokens": n, "ms": _ms(t.total_s), "gflops": round(shape.flops(setup.model.config) / t.total_s / 1e9, 1)})
        if progress:
            progress.update()
    return {"points": points, "steps": find_steps([p["tokens"] for p in points], [p["ms"] for p in points], threshold)}


def find_steps(tokens: list[int], times: list[float], threshold: float = 0.08) -> list[dict]:
    """Token counts where time jumps by more than `threshold` and stays up for the next points.

    "Stays up": the median of the next three points is still above the jump's base by most of the
    jump, which tells a step in the kernel's tiling from a single noisy sample.
    """
    steps = []
    for i in range(1, len(times)):
        before, after = times[i - 1], times[i]
        if before <= 0 or after / before - 1 <= threshold:
            continue
        following = times[i: i + 3]
        if len(following) < 2:
            continue
        previous = statistics.median(times[max(0, i - 3): i])
        if statistics.median(following) - previous < 0.7 * (after - before):
            continue
        steps.append({"tokens": tokens[i], "ms_before": before, "ms_after": after,
                      "jump": round(after / before - 1, 3)})
    return steps


def tile_steps(start: int, stop: int) -> int:
    return stop - start + 1


def paper_plan(quick: bool) -> dict:
    """Arguments of each experiment for `charioteer bench paper` (full: under an hour here)."""
    if quick:
        return {
            "profile": {"seq_len": 256, "batch_size": 4, "fig3_batch_sizes": (1, 2, 16), "repeats": 3},
            "decode_speedup": {"seq_lens": (256,), "batch_sizes": (2, 8, 16), "chunk_size": 32, "repeats": 5},
            "e2e": {"chunk_sizes": (49,), "pd_ratios": (), "batch_size": 16, "seq_len": 256, "num_requests": 32},
            "chunk_ablation": {"seq_len": 256, "chunk_sizes": (17, 49, 128), "batch_size": 16, "with_e2e": False},
            "tile": {"start": 56, "stop": 72, "repeats": 2},
        }
    return {
        "profile": {"seq_len": 256, "batch_size": 4, "fig3_batch_sizes": (1, 2, 16), "repeats": 5},
        "decode_speedup": {"seq_lens": (256, 512, 768), "batch_sizes": (2, 4, 8, 12, 16), "chunk_size": 32, "repeats": 7},
        "e2e": {"chunk_sizes": (17, 33, 49), "pd_ratios": (0.5, 1, 2, 4, 8, 16), "batch_size": 16,
                "seq_len": 256, "num_requests": 64},
        "chunk_ablation": {"seq_len": 256, "chunk_sizes": (17, 33, 49, 64, 96, 128), "batch_size": 16,
                           "num_requests": 64},
        "tile": {"start": 1, "stop": 160, "repeats": 3},
    }


def threads() -> int:
    return torch.get_num_threads()
