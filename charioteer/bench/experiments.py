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

Noise: every configuration runs `repeats` times, interleaved (`stats.interleaved`: A B A B, not
A A B B), and every number is reported as its median with its spread (`x` and `x_spread`, min to
max). Comparisons carry a verdict (`stats.verdict`): a ratio of medians, and "faster"/"slower" only
when the spreads do not overlap. MFUs go through `roofline.mfu` (`Setup.record_mfu`/`settle_mfu`),
so they never exceed 1 and all of a run's use one peak.
"""
from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass, field

import torch

from charioteer.bench.batch_timer import BatchShape, BatchTimer
from charioteer.bench.ceiling import mfu_ceiling, model_shape_of, priced, roofline_makespan
from charioteer.bench.e2e import POLICIES, Workload, balanced_pd, engine_args, pd_grid, run_e2e
from charioteer.bench.roofline import mfu
from charioteer.bench.stats import compare, interleaved, median, put, put_mfu
from charioteer.model.config import ModelConfig
from charioteer.model.llama import LlamaModel
from charioteer.model.loader import LoadedModel, load_model
from charioteer.model.precision import dtype_name, resolve_dtype

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
    roofline: dict  # in the model's dtype
    mfu_cells: list = field(default_factory=list)  # (row, column, flops, seconds samples), see record_mfu

    @property
    def precision(self) -> dict:
        """The model's number formats as engine settings: an engine built for this setup runs the same."""
        return {"dtype": dtype_name(self.model.dtype), "quantization": self.model.quantization}

    def record_mfu(self, row: dict, column: str, flops: float, seconds: list[float]) -> None:
        """Ask for row[column]: the MFU of `flops` done in each of `seconds` (median and spread).
        `settle_mfu` writes it, and rewrites every earlier one, so all of them use one peak."""
        self.mfu_cells.append((row, column, flops, list(seconds)))

    def settle_mfu(self) -> None:
        """Write every recorded MFU through roofline.mfu, which may raise the peak first."""
        values = iter(mfu(self.roofline, [(f, t) for _, _, f, samples in self.mfu_cells for t in samples]))
        for row, column, _, samples in self.mfu_cells:
            put_mfu(row, column, [next(values) for _ in samples])


def make_setup(model: str | None, device: str, roofline: dict, num_layers: int | None = None,
               max_cached_tokens: int = 32768, quantization: str | None = None, dtype: str | None = None) -> Setup:
    """The model in `dtype` (default: the roofline's) and `quantization`, its batch timer, and the roofline.
    Every row runs through every layer (`full_last_layer`), as in the paper's engine: the default model is
    one layer that stands for each of LLaMA-7B's."""
    loaded = load_model(model or DEFAULT_BENCH_MODEL, num_layers=num_layers)
    dtype = resolve_dtype(dtype or roofline.get("dtype", "float32"), torch.device(device))
    llama = LlamaModel(loaded.config, loaded.state_dict, device, dtype=dtype,
                       quantization=quantization, full_last_layer=True)
    return Setup(loaded, llama, BatchTimer(llama, max_cached_tokens), device, roofline)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _tick(progress, every: int = 1):
    """A callback that advances `progress` by one every `every` calls (None without a bar)."""
    if not progress:
        return None
    calls = [0]

    def tick():
        calls[0] += 1
        if calls[0] % every == 0:
            progress.update()
    return tick


# ---- Table 2 and Figure 3 ----------------------------------------------------------------


def profile(setup: Setup, seq_len: int = 256, batch_size: int = 4, fig3_batch_sizes=(1, 2, 16),
            repeats: int = 5, progress=None) -> dict:
    """Per-operation times of prefill-only, decode-only and hybrid batches (Table 2), and Figure 3.

    Every batch of both is timed `repeats` times, interleaved; per-operation times are medians,
    totals and derived costs carry their spread (min to max).
    """
    if batch_size < 2 or seq_len <= batch_size:
        raise ValueError(f"profile needs batch_size >= 2 and seq_len > batch_size, got {batch_size}, {seq_len}")
    chunk = seq_len - (batch_size - 1)
    table = {
        "prefill-only": BatchShape(prefills=((seq_len, 0),) * batch_size),
        "decode-only": BatchShape(decodes=(seq_len,) * batch_size),
        "hybrid": BatchShape(prefills=((chunk, 0),), decodes=(seq_len,) * (batch_size - 1)),
        "hybrid's chunk alone": BatchShape(prefills=((chunk, 0),)),
    }
    fig3 = {}
    for b in fig3_batch_sizes:
        fig3[f"prefill x{b}"] = BatchShape(prefills=((seq_len, 0),) * b)
        fig3[f"decode x{b}"] = BatchShape(decodes=(seq_len,) * b)
    timings = setup.timer.time_interleaved({**table, **fig3}, repeats, after_each=_tick(progress))
    rows = []
    for kind in table:
        t = timings[kind]
        shape = t.shape
        row = {"batch": kind, "prefill_tokens": shape.num_prefill_tokens, "decodes": len(shape.decodes),
               **{f"{op}_ms": _ms(s) for op, s in t.ops_s.items()}}
        put(row, "total_ms", t.samples_s, 1e3)
        put(row, "ms_per_token", t.samples_s, 1e3 / shape.num_tokens)
        setup.record_mfu(row, "mfu", shape.flops(setup.model.config), t.samples_s)
        rows.append(row)
    # Per round: a decode's marginal cost in the hybrid batch, and its cost in a decode-only batch.
    marginal = [(h - c) / (batch_size - 1) for h, c in zip(timings["hybrid"].samples_s,
                                                          timings["hybrid's chunk alone"].samples_s)]
    alone = [t / batch_size for t in timings["decode-only"].samples_s]
    out = {"seq_len": seq_len, "batch_size": batch_size, "repeats": repeats, "table2": rows}
    put(out, "decode_ms_per_token_alone", alone, 1e3)
    put(out, "decode_ms_per_token_in_hybrid", marginal, 1e3)
    compare(out, "decode_speedup_in_hybrid", marginal, alone, higher_is_better=False)
    figure3 = []
    for b in fig3_batch_sizes:
        pre = [t / (b * seq_len) for t in timings[f"prefill x{b}"].samples_s]
        dec = [t / b for t in timings[f"decode x{b}"].samples_s]
        row = {"batch_size": b}
        put(row, "prefill_ms_per_token", pre, 1e3)
        put(row, "decode_ms_per_token", dec, 1e3)
        row["decode_over_prefill"] = round(median(dec) / median(pre), 1)
        row["decode_over_prefill_spread"] = [round(min(dec) / max(pre), 1), round(max(dec) / min(pre), 1)]
        figure3.append(row)
    out["figure3"] = figure3
    setup.settle_mfu()
    return out


def profile_steps(fig3_batch_sizes, repeats: int) -> int:
    return (4 + 2 * len(fig3_batch_sizes)) * repeats


# ---- Figure 8: decode speedup ------------------------------------------------------------


def decode_speedup(setup: Setup, seq_lens=(256, 512, 768), batch_sizes=(2, 4, 8, 12, 16), chunk_size: int = 32,
                   repeats: int = 7, progress=None) -> dict:
    """Baseline decode time per token over the marginal decode time per token in a hybrid batch.

    Marginal = (hybrid batch - the same chunk alone) / decodes, per round. Batch size b means
    1 chunk + (b - 1) decodes in the hybrid batch and b decodes in the baseline's decode-only
    batch. The three batches of a point are timed interleaved, `repeats` rounds. decode_speedup
    is the ratio of the medians, its spread the ratios the two costs' spreads allow, and verdict
    whether a piggybacked decode is distinguishably faster than a decode alone.
    """
    rows = []
    for seq_len in seq_lens:
        for b in batch_sizes:
            if b < 2:
                raise ValueError(f"decode speedup needs batch sizes >= 2 (one chunk plus decodes), got {b}")
            shapes = {"hybrid": BatchShape(prefills=((chunk_size, 0),), decodes=(seq_len,) * (b - 1), prefills_sample=False),
                      "chunk": BatchShape(prefills=((chunk_size, 0),), prefills_sample=False),
                      "baseline": BatchShape(decodes=(seq_len,) * b)}
            t = setup.timer.time_interleaved(shapes, repeats, after_each=_tick(progress))
            per_token = [x / b for x in t["baseline"].samples_s]
            marginal = [(h - c) / (b - 1) for h, c in zip(t["hybrid"].samples_s, t["chunk"].samples_s)]
            row = {"seq_len": seq_len, "batch_size": b, "chunk_size": chunk_size}
            compare(row, "decode_speedup", marginal, per_token, higher_is_better=False, verdict_name="verdict")
            put(row, "baseline_decode_ms_per_token", per_token, 1e3)
            put(row, "hybrid_decode_ms_per_token", marginal, 1e3)
            for name in shapes:
                put(row, f"{name}_batch_ms", t[name].samples_s, 1e3)
            setup.record_mfu(row, "baseline_mfu", shapes["baseline"].flops(setup.model.config), t["baseline"].samples_s)
            setup.record_mfu(row, "hybrid_mfu", shapes["hybrid"].flops(setup.model.config), t["hybrid"].samples_s)
            rows.append(row)
    setup.settle_mfu()
    return {"chunk_size": chunk_size, "repeats": repeats, "rows": rows}


def decode_speedup_steps(seq_lens, batch_sizes, repeats: int) -> int:
    return len(seq_lens) * len(batch_sizes) * 3 * repeats


# ---- Figures 9, 10, 11: end-to-end throughput ----------------------------------------------

E2E_STATIC = ("policy", "chunk_size", "pd_ratio", "batch_size", "seq_len", "prompt_len", "decode_len", "num_requests",
              "batches", "prefill_only_batches", "decode_only_batches", "hybrid_batches", "piggybacked_decode_fraction")


def warm_up(setup: Setup, seq_len: int, batch_size: int) -> None:
    """One short run of the engine, so that the first measured run is not the first run."""
    run_e2e(setup.loaded, "sarathi", max(1, seq_len // 4), batch_size, Workload(seq_len, 1.0, 2), setup.device,
            precision=setup.precision)


def e2e_runs(setup: Setup, configs: list[tuple[str, int]], batch_size: int, workload: Workload, repeats: int,
             op_breakdown: bool = False, progress=None) -> dict[tuple[str, int], dict]:
    """Run each (policy, chunk size) on the workload `repeats` times, interleaved; one row per config
    with throughput and elapsed time as median and spread (the samples are kept), MFU recorded."""
    runs = interleaved([((policy, c), functools.partial(run_e2e, setup.loaded, policy, c, batch_size, workload,
                                                        setup.device, op_breakdown=op_breakdown,
                                                        precision=setup.precision))
                        for policy, c in configs], repeats, after_each=_tick(progress))
    out = {}
    for key, samples in runs.items():
        row = {k: samples[0][k] for k in E2E_STATIC}
        elapsed = [r["elapsed_s"] for r in samples]
        put(row, "throughput_tok_s", [r["throughput_tok_s"] for r in samples], digits=2)
        put(row, "elapsed_s", elapsed)
        row["throughput_tok_s_samples"] = [r["throughput_tok_s"] for r in samples]
        if "ops_s" in samples[0]:
            row["ops_s"] = {op: round(median(r["ops_s"][op] for r in samples), 3) for op in samples[0]["ops_s"]}
        setup.record_mfu(row, "mfu", workload_flops(setup, workload), elapsed)
        out[key] = row
    return out


def e2e(setup: Setup, chunk_sizes=(17, 33, 49), pd_ratios=(0.5, 1, 2, 4, 8, 16), batch_size: int = 16,
        seq_len: int = 256, num_requests: int = 64, policies=POLICIES, repeats: int = 3, progress=None) -> dict:
    """P:D sweep (Figures 9, 11b), per-operation breakdown at the balanced point (Figure 10).

    At each P:D every policy (and sarathi at each chunk size) runs `repeats` times, interleaved.
    Gains are ratios of median throughputs with a verdict from the spreads: against request-level
    for every row, against Orca's best case for sarathi's.
    """
    grid = pd_grid(list(chunk_sizes), batch_size, list(pd_ratios))
    warm_up(setup, seq_len, batch_size)
    rows, points = [], []
    for pd in grid:
        workload = Workload(seq_len, pd, num_requests)
        balanced = any(math.isclose(pd, round(balanced_pd(c, batch_size), 2)) for c in chunk_sizes)
        # orca-worst matches request-level by construction; Figure 11a needs it at the balanced points only.
        configs = [(p, c) for p in policies if p != "orca-worst" or balanced or len(grid) == 1
                   for c in (chunk_sizes if p == "sarathi" else chunk_sizes[:1])]
        # Figure 10 needs the per-operation breakdown only at the balanced points.
        point = e2e_runs(setup, configs, batch_size, workload, repeats, op_breakdown=balanced, progress=progress)
        _gains(point, balanced_pd, batch_size)
        rows += point.values()
        points.append((point, workload))
    setup.settle_mfu()
    for point, workload in points:
        _roofline_bounds(setup, point, workload, batch_size)
    return {"batch_size": batch_size, "seq_len": seq_len, "num_requests": num_requests, "repeats": repeats,
            "chunk_sizes": list(chunk_sizes), "pd_ratios": grid, "rows": rows, "peaks": _peaks(rows, chunk_sizes, batch_size)}


def _gains(point: dict, balanced, batch_size: int) -> None:
    baseline = next((r for (p, _), r in point.items() if p == "request-level"), None)
    orca = next((r for (p, _), r in point.items() if p == "orca-best"), None)
    for (policy, c), row in point.items():
        row["balanced_pd"] = round(balanced(c, batch_size), 2) if policy == "sarathi" else None
        if baseline is not None:
            compare(row, "gain_vs_request_level", row["throughput_tok_s_samples"], baseline["throughput_tok_s_samples"],
                    verdict_name="vs_request_level")
        if orca is not None and policy == "sarathi":
            compare(row, "gain_vs_orca_best", row["throughput_tok_s_samples"], orca["throughput_tok_s_samples"],
                    verdict_name="vs_orca_best")


def _roofline_bounds(setup: Setup, point: dict, workload: Workload, batch_size: int) -> None:
    """Each row's `mfu_ceiling` and `roofline_gain` (over request-level): its policy's batches, as the simulator
    plans them with the engine's scheduler, each at the roofline alone (bench.ceiling): where the measured curve
    can peak at all on this machine. None for a precision the simulator does not price (GGUF blocks)."""
    if not priced(**setup.precision):
        return
    shape = model_shape_of(setup.loaded.config, **setup.precision)
    n, flops = workload.num_requests, workload_flops(setup, workload)
    spans = {key: roofline_makespan(shape, setup.roofline, engine_args(key[0], key[1], batch_size, workload,
                                                                       setup.device).to_kwargs(),
                                    [workload.prompt_len] * n, [workload.decode_len] * n) for key in point}
    baseline = next((t for (policy, _), t in spans.items() if policy == "request-level"), None)
    for key, row in point.items():
        row["mfu_ceiling"] = round(mfu_ceiling(flops, spans[key], setup.roofline), 3)
        if baseline is not None:
            row["roofline_gain"] = round(baseline / spans[key], 3)


def _roofline_peak(rows: list[dict]) -> float | None:
    """The P:D of the rows' largest roofline gain; None where none has one (an unpriced precision)."""
    priced_rows = [r for r in rows if r.get("roofline_gain") is not None]
    return max(priced_rows, key=lambda r: r["roofline_gain"])["pd_ratio"] if priced_rows else None


def _peaks(rows: list[dict], chunk_sizes, batch_size: int) -> list[dict]:
    peaks = []
    for c in chunk_sizes:
        mine = [r for r in rows if r["policy"] == "sarathi" and r["chunk_size"] == c and r.get("gain_vs_request_level")]
        if mine:
            best = max(mine, key=lambda r: r["gain_vs_request_level"])
            target = balanced_pd(c, batch_size)
            peaks.append({"chunk_size": c, "balanced_pd": round(target, 2), "peak_pd": best["pd_ratio"],
                          "peak_gain": best["gain_vs_request_level"],
                          "peak_gain_spread": best["gain_vs_request_level_spread"],
                          "peak_vs_request_level": best["vs_request_level"],
                          "peak_within_30pct": abs(best["pd_ratio"] - target) <= 0.3 * target,
                          "roofline_peak_pd": _roofline_peak(mine)})
    return peaks


def e2e_steps(chunk_sizes, pd_ratios, batch_size, policies, repeats: int) -> int:
    grid = pd_grid(list(chunk_sizes), batch_size, list(pd_ratios))
    per_pd = sum(len(chunk_sizes) if p == "sarathi" else 1 for p in policies if p != "orca-worst")
    worst = 0 if "orca-worst" not in policies else len(grid) if len(grid) == 1 else len(
        {round(balanced_pd(c, batch_size), 2) for c in chunk_sizes})
    return (per_pd * len(grid) + worst) * repeats


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
                   num_requests: int = 64, repeats: int = 3, with_e2e: bool = True, progress=None,
                   e2e_result: dict | None = None) -> dict:
    """Prefill attention time and total prefill time of a chunked prompt against the whole prompt
    (Figure 13a, b), and end-to-end throughput at each chunk's balanced P:D (Figure 13c).

    The whole prompt and every chunk of every chunk size are timed in the same rounds, interleaved;
    a chunk size's time in a round is the sum of its chunks'. Speedups are whole over chunked, as
    ratios of medians with their spreads; the e2e part runs request-level and sarathi `repeats`
    times each, interleaved, unless `e2e_result` (an `e2e()` result of the same L, B and request
    count) already holds both at that chunk size's balanced P:D: then its runs are used.
    """
    shapes = {"whole": BatchShape(prefills=((seq_len, 0),))}
    for c in chunk_sizes:
        for start in range(0, seq_len, c):
            n = min(c, seq_len - start)
            shapes[(c, start)] = BatchShape(prefills=((n, start),), prefills_sample=start + n == seq_len)
    t = setup.timer.time_interleaved(shapes, repeats, after_each=_tick(progress))
    whole, whole_attention = t["whole"].samples_s, t["whole"].op_samples("attention")
    if with_e2e and any(_known_e2e(e2e_result, Workload(seq_len, balanced_pd(c, batch_size), num_requests), c,
                                   batch_size) is None for c in chunk_sizes):
        warm_up(setup, seq_len, batch_size)
    rows = []
    for c in chunk_sizes:
        parts = [t[k] for k in shapes if k != "whole" and k[0] == c]
        total = [sum(p.samples_s[i] for p in parts) for i in range(repeats)]
        attention = [sum(p.op_samples("attention")[i] for p in parts) for i in range(repeats)]
        row = {"chunk_size": c}
        put(row, "prefill_attention_ms", attention, 1e3)
        put(row, "prefill_total_ms", total, 1e3)
        compare(row, "attention_speedup", attention, whole_attention, higher_is_better=False)
        compare(row, "prefill_speedup", total, whole, higher_is_better=False)
        if with_e2e:
            workload = Workload(seq_len, balanced_pd(c, batch_size), num_requests)
            known = _known_e2e(e2e_result, workload, c, batch_size)
            if known:
                base, mine = known
                row["e2e_runs_from"] = "e2e"
            else:
                runs = e2e_runs(setup, [("request-level", c), ("sarathi", c)], batch_size, workload, repeats,
                                progress=progress)
                base, mine = runs[("request-level", c)], runs[("sarathi", c)]
            row.update({"pd_ratio": round(workload.pd_ratio, 2), "sarathi_tok_s": mine["throughput_tok_s"],
                        "sarathi_tok_s_spread": mine["throughput_tok_s_spread"],
                        "request_level_tok_s": base["throughput_tok_s"],
                        "request_level_tok_s_spread": base["throughput_tok_s_spread"]})
            compare(row, "e2e_speedup", mine["throughput_tok_s_samples"], base["throughput_tok_s_samples"],
                    verdict_name="e2e_verdict")
        rows.append(row)
    out = {"seq_len": seq_len, "batch_size": batch_size, "repeats": repeats, "rows": rows}
    put(out, "whole_prefill_ms", whole, 1e3)
    put(out, "whole_prefill_attention_ms", whole_attention, 1e3)
    setup.settle_mfu()
    return out


def _known_e2e(e2e_result: dict | None, workload: Workload, c: int, batch_size: int) -> tuple[dict, dict] | None:
    """(request-level row, sarathi row) of an e2e() result at exactly this workload and chunk size, if it has both."""
    if not e2e_result or (e2e_result["seq_len"], e2e_result["batch_size"], e2e_result["num_requests"]) != (
            workload.seq_len, batch_size, workload.num_requests):
        return None
    at = [r for r in e2e_result["rows"] if r["pd_ratio"] == round(workload.pd_ratio, 3)]
    base = next((r for r in at if r["policy"] == "request-level"), None)
    mine = next((r for r in at if r["policy"] == "sarathi" and r["chunk_size"] == c), None)
    return (base, mine) if base and mine else None


def chunk_ablation_steps(seq_len: int, chunk_sizes, repeats: int, with_e2e: bool, known_chunk_sizes=()) -> int:
    shapes = 1 + sum(math.ceil(seq_len / c) for c in chunk_sizes)
    e2e = 2 * len(set(chunk_sizes) - set(known_chunk_sizes)) if with_e2e else 0
    return (shapes + e2e) * repeats


# ---- Figure 7: tile quantization -----------------------------------------------------------


def tile_sweep(setup: Setup, start: int = 1, stop: int = 160, repeats: int = 3, threshold: float = 0.08,
               progress=None) -> dict:
    """Iteration time of a prefill of n tokens, n = start..stop in steps of 1; report any step.

    Every n is timed once per round, `repeats` rounds (interleaved); steps are found on the
    medians. A step is an n where the time jumps by more than `threshold` (relative) over n - 1,
    while adding a token costs only ~1/n more work, and the next points stay up (a real step, not
    noise).
    """
    shapes = {n: BatchShape(prefills=((n, 0),), prefills_sample=False) for n in range(start, stop + 1)}
    t = setup.timer.time_interleaved(shapes, repeats, after_each=_tick(progress, every=repeats))
    points = []
    for n, shape in shapes.items():
        point = {"tokens": n}
        put(point, "ms", t[n].samples_s, 1e3)
        point["gflops"] = round(shape.flops(setup.model.config) / t[n].total_s / 1e9, 1)
        setup.record_mfu(point, "mfu", shape.flops(setup.model.config), t[n].samples_s)
        points.append(point)
    setup.settle_mfu()
    return {"repeats": repeats, "points": points,
            "steps": find_steps([p["tokens"] for p in points], [p["ms"] for p in points], threshold)}


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
    return stop - start + 1  # tile_sweep advances the bar once per `repeats` runs


def paper_plan(quick: bool, repeats: int | None = None) -> dict:
    """Arguments of each experiment for `charioteer bench paper`; `repeats` replaces every experiment's own.

    End-to-end runs dominate the time: the full plan makes 60 of them (32 requests of 256 tokens
    each) and --quick 8, against 48 single runs of 64 requests before runs were repeated.
    """
    if quick:
        plan = {
            "profile": {"seq_len": 256, "batch_size": 4, "fig3_batch_sizes": (1, 2, 16), "repeats": 3},
            "decode_speedup": {"seq_lens": (256,), "batch_sizes": (2, 8, 16), "chunk_size": 32, "repeats": 3},
            "e2e": {"chunk_sizes": (49,), "pd_ratios": (), "batch_size": 16, "seq_len": 256, "num_requests": 32,
                    "repeats": 2},
            "chunk_ablation": {"seq_len": 256, "chunk_sizes": (17, 49, 128), "batch_size": 16, "with_e2e": False,
                               "repeats": 3},
            "tile": {"start": 56, "stop": 72, "repeats": 3},
        }
    else:
        plan = {
            "profile": {"seq_len": 256, "batch_size": 4, "fig3_batch_sizes": (1, 2, 16), "repeats": 5},
            "decode_speedup": {"seq_lens": (256, 512, 768), "batch_sizes": (2, 4, 8, 12, 16), "chunk_size": 32,
                               "repeats": 5},
            # 14 configurations x 3 runs at P:D 2.2, 3.27 (the balanced points of C = 33, 49) and 8, then
            # 3 more chunk sizes x 2 policies x 3 runs for Figure 13c (33 and 49 reuse these runs).
            "e2e": {"chunk_sizes": (33, 49), "pd_ratios": (8,), "batch_size": 16,
                    "seq_len": 256, "num_requests": 32, "repeats": 3},
            "chunk_ablation": {"seq_len": 256, "chunk_sizes": (17, 33, 49, 64, 128), "batch_size": 16,
                               "num_requests": 32, "repeats": 3},
            "tile": {"start": 1, "stop": 160, "repeats": 3},
        }
    if repeats is not None:
        for args in plan.values():
            args["repeats"] = repeats
    return plan


def shared_e2e(plan: dict) -> bool:
    """Whether the plan's chunk ablation can reuse its e2e runs (same L, B and requests per run)."""
    e, ca = plan["e2e"], plan["chunk_ablation"]
    return ca.get("with_e2e", True) and all(e.get(k) == ca.get(k) for k in ("seq_len", "batch_size", "num_requests"))


def paper_steps(plan: dict) -> int:
    """Progress-bar steps of a paper plan: one per timed batch run or end-to-end run."""
    pr, ds, e, ca, t = (plan[k] for k in ("profile", "decode_speedup", "e2e", "chunk_ablation", "tile"))
    return (profile_steps(pr["fig3_batch_sizes"], pr["repeats"])
            + decode_speedup_steps(ds["seq_lens"], ds["batch_sizes"], ds["repeats"])
            + e2e_steps(e["chunk_sizes"], e["pd_ratios"], e["batch_size"], POLICIES, e["repeats"])
            + chunk_ablation_steps(ca["seq_len"], ca["chunk_sizes"], ca["repeats"], ca.get("with_e2e", True),
                                   e["chunk_sizes"] if shared_e2e(plan) else ())
            + tile_steps(t["start"], t["stop"]))


def threads() -> int:
    return torch.get_num_threads()
