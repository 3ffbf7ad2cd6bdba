"""`charioteer bench single-stream`: one request's decode speed in each weight format, against the
read-bandwidth limit of the bytes that one decode step must stream.

A decode step of one request reads every linear weight, the norms and the LM head once, and its
own cached K and V: nothing is reused, so its time is bounded below by those bytes over the
machine's read bandwidth (`roofline`'s, a matrix-vector product over 512 MB). Each format runs in
its own engine, all built at the start and run interleaved (fp32, bf16, int8, fp32, ...); a round
generates `--new-tokens` tokens after a `--prompt-len`-token prompt, and its result is the median
time of its decode-only steps. Each round also reads the bandwidth again, so every step is set
against the stored (best) bandwidth and against what the memory gave in the same round.

Formats: float32; bfloat16 (weights, activations and KV); int8 (weight-only int8 linear layers and
LM head, fp32 activations and KV, `quantization="int8"`); gguf (the GGUF file's own quantized blocks,
fp32 activations and KV, `quantization="gguf"`).

With `--parts` each round also times each format's step apart (charioteer.bench.decode_parts): its layers
from memory, its LM head and a layer in the caches, each set against the same round's read limit.
"""
from __future__ import annotations

import sys

import numpy as np

from charioteer.bench.decode_parts import CACHED_LAYERS, DecodeParts
from charioteer.bench.common import (PRECISION_SETTINGS, add_engine_bench_args, choices, emit, format_table,
                                     load_engine_bench, progress_bar)
from charioteer.bench.roofline import (bandwidth_reader, cpu_features, cpu_model, last_level_cache_bytes,
                                      observe_bandwidth, roofline)
from charioteer.bench.stats import cell, compare, interleaved, median, put
from charioteer.config import EngineArgs, setting_kwargs
from charioteer.engine.llm_engine import LLMEngine
from charioteer.request import SamplingParams


def decode_step_times(engine: LLMEngine, prompt: list[int], new_tokens: int) -> list[float]:
    """Durations (s) of the decode-only steps of one request generating `new_tokens` tokens alone."""
    steps = []
    unsubscribe = engine.subscribe(lambda record: steps.append(record.duration_s) if record.kind == "decode" else None)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    unsubscribe()
    return steps


def streamed_bytes(engine: LLMEngine, context: float) -> float:
    """Bytes one decode step reads: the weights a step streams and `context` positions of K and V."""
    return engine.runner.model.streamed_weight_bytes + context * engine.kv_token_bytes


READ_TRIALS = 5  # trials of the read bandwidth in each round, beside that round's decode steps
ROUND_BANDWIDTH = "read bandwidth"  # the interleaved run that reads the bandwidth


def variants(formats: list[str], scheduler_steps: list[int]) -> dict[str, tuple[str, int]]:
    """Each run's label -> (format, num_scheduler_steps): every format at each number of steps, the format's
    name alone at one step, `format@K` at K; a format's runs side by side (the rounds run in this order, and a
    shared machine's bandwidth moves within one)."""
    return {fmt if k == 1 else f"{fmt}@{k}": (fmt, k) for fmt in formats for k in scheduler_steps}


def baseline(label: str, runs_of: dict[str, tuple[str, int]], first: str) -> str:
    """What a run is compared with: its format at one step where that ran (`format@K` against `format`),
    else the first run."""
    fmt, steps = runs_of[label]
    return fmt if steps > 1 and fmt in runs_of else first


def measure(loaded, engine_kwargs: dict, formats: list[str], prompt: list[int], new_tokens: int, repeats: int,
            roof: dict, progress=None, scheduler_steps: tuple[int, ...] = (1,), parts: bool = False) -> dict:
    """Each format's decode step against two read limits:
    - `of_limit`: `roof`'s stored bandwidth, which the fastest step (or round's reading) first holds to
      its rate (roofline.observe_bandwidth), so no fraction of the limit exceeds 1;
    - `of_round_limit`: the bandwidth read in the same round (`roofline.bandwidth_reader`, one more run
      among the interleaved formats), or the round's fastest step's read rate where that is higher. A
      shared machine's bandwidth moves by a third from one hour to the next, so this pairs each step
      with what the memory gave at that time.
    Only the steps whose bytes outgrow the last-level cache count as reads of memory: a format that fits in it
    (`fits_last_level_cache`; SmolLM2's GGUF in a Xeon's 480 MB L3) may read faster than the memory, and then its
    fractions exceed 1 rather than raising every format's limit and the stored bandwidth.
    `parts`: also each format's step taken apart (DecodeParts), once a round, as `parts` rows."""
    runs_of = variants(formats, list(scheduler_steps))
    engines = {label: LLMEngine(EngineArgs(**{**engine_kwargs, "num_scheduler_steps": k}, **PRECISION_SETTINGS[f]),
                                loaded=loaded) for label, (f, k) in runs_of.items()}
    formats = list(runs_of)
    read_bandwidth = bandwidth_reader("cpu")
    runs = {f: (lambda f=f: median(decode_step_times(engines[f], prompt, new_tokens))) for f in formats}
    taken_apart = {}
    if parts:  # one per format, on its first run's engine (the parts do not depend on the steps a plan runs)
        firsts: dict[str, str] = {}
        for label, (fmt, _) in runs_of.items():
            firsts.setdefault(fmt, label)
        taken_apart = {label: p for label in firsts.values()
                       if (p := DecodeParts.build(engines[label].runner.model, len(prompt))) is not None}
        runs.update({f"{label} parts": p.time for label, p in taken_apart.items()})
    runs[ROUND_BANDWIDTH] = lambda: read_bandwidth(READ_TRIALS)
    samples = interleaved(runs, repeats, warmup=1, after_each=progress.update if progress else None)
    context = len(prompt) + new_tokens / 2  # the mean context of the decode steps
    reads = {f: streamed_bytes(engines[f], context) for f in formats}
    cache_bytes = last_level_cache_bytes()
    from_memory = [f for f in formats if reads[f] > cache_bytes]
    # a round's limit is at least what its fastest step from memory read (as roofline.observe_bandwidth holds the
    # stored one)
    round_bandwidths = [max([reading] + [reads[f] / samples[f][i] for f in from_memory])
                        for i, reading in enumerate(samples.pop(ROUND_BANDWIDTH))]
    part_rows = [_parts_row(label, p, samples.pop(f"{label} parts"), samples[label],
                            streamed_bytes(engines[label], len(prompt)), round_bandwidths)
                 for label, p in taken_apart.items()]
    observe_bandwidth(roof, max(round_bandwidths))  # each already at least its steps' read rates
    bandwidth_gbs = roof["memory_bandwidth_gbs"]
    rows = [{**_format_row(f, samples[f], reads[f], bandwidth_gbs, round_bandwidths),
             "fits_last_level_cache": f not in from_memory} for f in formats]
    result = {"rows": rows, "last_level_cache_mb": round(cache_bytes / 1e6)}
    if parts:
        result["parts"] = part_rows
    put(result, "round_bandwidth_gbs", round_bandwidths, scale=1e-9, digits=1)
    result["comparisons"] = [(label, baseline(label, runs_of, formats[0])) for label in formats[1:]]
    for label, base in result["comparisons"]:
        compare(result, f"{label}_over_{base}", [1 / s for s in samples[label]], [1 / s for s in samples[base]])
    return result


def _format_row(fmt: str, steps: list[float], read: float, bandwidth_gbs: float, round_bandwidths: list[float]) -> dict:
    row = {"format": fmt}
    step = put(row, "step_ms", steps, scale=1e3)
    put(row, "tok_s", [1 / s for s in steps])
    row["streamed_mb"] = round(read / 1e6, 1)
    row["limit_tok_s"] = round(bandwidth_gbs * 1e9 / read, 1)
    of_limit = read / (bandwidth_gbs * 1e9) / step.median
    # none above 1: a step that reads faster than the bandwidth fits in the cache, or ran at a rate
    # observe_bandwidth found implausible
    row["of_limit"] = round(of_limit, 3) if of_limit <= 1 else None
    put(row, "of_round_limit", [read / b / s for b, s in zip(round_bandwidths, steps)])
    row["achieved_gbs"] = round(read / step.median / 1e9, 1)
    return row


def _parts_row(label: str, parts: DecodeParts, rounds: list[dict], steps: list[float], read: float,
               round_bandwidths: list[float]) -> dict:
    """A run's step taken apart, each part against its round's read limit: the layers' bytes (the step's read at
    the prompt's context, less the head's) and the head's; `around_ms`: the run's step less its layers and head."""
    layer_bytes, head_bytes = read - parts.head_bytes, parts.head_bytes
    layers, head = [r["layers_s"] for r in rounds], [r["head_s"] for r in rounds]
    row = {"format": label}
    put(row, "layers_ms", layers, scale=1e3)
    put(row, "layers_of_round", [layer_bytes / b / t for b, t in zip(round_bandwidths, layers)])
    put(row, "head_ms", head, scale=1e3)
    put(row, "head_of_round", [head_bytes / b / t for b, t in zip(round_bandwidths, head)])
    put(row, "cached_layer_us", [r["cached_layer_s"] for r in rounds], scale=1e6, digits=1)
    put(row, "around_ms", [s - a - b for s, a, b in zip(steps, layers, head)], scale=1e3)
    return row


def scheduler_steps(text: str) -> list[int]:
    """--scheduler-steps: distinct integers >= 1, comma-separated; ValueError otherwise."""
    words = [w.strip() for w in text.split(",")]
    steps = [int(w) for w in words if w.isdigit()]
    if len(steps) < len(words) or min(steps) < 1 or len(set(steps)) < len(steps):
        raise ValueError(f"--scheduler-steps takes distinct integers >= 1, comma-separated, got {text!r}")
    return steps


def cmd_bench_single_stream(args) -> int:
    formats = choices(args.formats, PRECISION_SETTINGS, "--formats")
    steps = scheduler_steps(args.scheduler_steps)
    loaded = load_engine_bench(args)
    engine_kwargs = {**setting_kwargs(args), "model": loaded.source, "max_num_seqs": 1}
    prompt = np.random.default_rng(args.seed).integers(1, loaded.config.vocab_size, args.prompt_len).tolist()
    roof = roofline("cpu")
    print(f"model: {loaded.config.name}; one request, {args.prompt_len} prompt tokens, {args.new_tokens} generated; "
          f"read bandwidth {roof['memory_bandwidth_gbs']} GB/s", file=sys.stderr)
    with progress_bar((len(formats) * (len(steps) + args.parts) + 1) * args.repeats, "runs") as bar:
        result = measure(loaded, engine_kwargs, formats, prompt, args.new_tokens, args.repeats, roof, bar, steps,
                         args.parts)
    result.update({"model": loaded.config.name, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   "repeats": args.repeats, "cpu": cpu_model(), "cpu_features": cpu_features(),
                   "memory_bandwidth_gbs": roof["memory_bandwidth_gbs"], "engine": engine_kwargs})
    lines = [f"{cpu_model()} ({'+'.join(cpu_features())}), read bandwidth {roof['memory_bandwidth_gbs']} GB/s "
             f"stored, {cell(result, 'round_bandwidth_gbs')} GB/s read beside the rounds; last-level cache "
             f"{result['last_level_cache_mb']} MB (a format that fits in it may beat the memory's limit)",
             format_table(result["rows"], ["format", "step_ms", "tok_s", "streamed_mb", "achieved_gbs", "limit_tok_s",
                                           "of_limit", "of_round_limit", "fits_last_level_cache"])]
    if args.parts:
        lines += [f"Each step taken apart (one decode at {args.prompt_len} positions, its own KV cache): the layers "
                  f"from memory, the LM head, a layer of the first {CACHED_LAYERS} in the caches, the rest of the step",
                  format_table(result["parts"], ["format", "layers_ms", "layers_of_round", "head_ms", "head_of_round",
                                                 "cached_layer_us", "around_ms"])
                  if result["parts"] else "(no format runs its decode step in one call here: nothing taken apart)"]
    lines += [f"{f} over {base}: {result[f'{f}_over_{base}']}x "
              f"{result[f'{f}_over_{base}_spread']} ({result[f'{f}_over_{base}_verdict']})"
              for f, base in result["comparisons"]]
    emit(args, result, "\n".join(lines))
    return 0


def add_single_stream_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "single-stream", help="one request's decode speed per weight format, against the read-bandwidth limit",
        description="One request at a time: the median decode step of each format (float32, bfloat16, int8, gguf) "
                    "over interleaved rounds, the bytes a step streams (weights, norms, LM head and the K/V "
                    "of its context) and the fraction of the read-bandwidth limit that it reaches: the stored "
                    "bandwidth's and the one read again in each round.")
    add_engine_bench_args(p, precision=False)  # --formats sets each engine's precision
    p.add_argument("--formats", default="float32,int8",
                   help=f"comma-separated subset of {','.join(PRECISION_SETTINGS)}; the first is the baseline "
                        "(default: float32,int8)")
    p.add_argument("--scheduler-steps", default="1",
                   help="comma-separated numbers of steps per decode plan (--num-scheduler-steps), each format run "
                        "at each, labelled format@K beside K=1 (default: 1)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per round (default: 64)")
    p.add_argument("--repeats", type=int, default=5, help="rounds of every format, after one warm-up (default: 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default: 0)")
    p.add_argument("--parts", action="store_true",
                   help="also time each format's step taken apart every round: its layers from memory, its LM head, "
                        "a layer in the caches, and the rest of the step")
    p.set_defaults(func=cmd_bench_single_stream)
