"""`charioteer bench partial-prefills`: short prompts behind one long prompt, with and without partial prefills.

One long prompt arrives, then, after its first iteration, several short ones. Three engines run
the scenario, interleaved round by round (alone, unfair, fair): `alone` serves each short prompt by
itself (its TTFT is the floor), `unfair` is the one-chunk plan (max_num_partial_prefills=1),
`fair` shares each iteration's prompt tokens among up to N prompts. Reported: the short prompts'
wall-clock TTFT (median over them, per round; then median and spread over rounds), their worst
TTFT, the long prompt's TTFT, and each short TTFT over its TTFT alone. Greedy outputs of the unfair
and fair runs are compared token by token.
"""
from __future__ import annotations

import sys

import numpy as np

from charioteer.bench.common import add_engine_bench_args, emit, format_table, load_engine_bench, progress_bar
from charioteer.bench.stats import compare, interleaved, median, put, verdict
from charioteer.config import EngineArgs, add_setting_args, setting_kwargs
from charioteer.engine.llm_engine import LLMEngine
from charioteer.request import SamplingParams

RUNS = ("alone", "unfair", "fair")


def make_prompts(vocab: int, long_len: int, short_len: int, num_short: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    draw = lambda n: rng.integers(1, vocab, n).tolist()  # noqa: E731
    return draw(long_len), [draw(short_len) for _ in range(num_short)]


def _drain(engine: LLMEngine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    return outputs


def _ttft(output) -> float:
    return output.metrics.first_token_time - output.metrics.arrival_time


def run_alone(engine: LLMEngine, shorts, params) -> dict:
    ttfts = []
    for prompt in shorts:
        engine.add_request(prompt, params)
        ttfts += [_ttft(o) for o in _drain(engine).values()]
    return {"short_ttft": median(ttfts), "short_ttft_max": max(ttfts)}


def run_behind(engine: LLMEngine, long_prompt, shorts, params) -> dict:
    long_id = engine.add_request(long_prompt, params)
    first = engine.step()  # the long prompt's first iteration
    ids = [engine.add_request(p, params) for p in shorts]
    outputs = {o.request_id: o for o in first if o.finished}
    outputs.update(_drain(engine))
    ttfts = [_ttft(outputs[i]) for i in ids]
    return {"short_ttft": median(ttfts), "short_ttft_max": max(ttfts), "long_ttft": _ttft(outputs[long_id]),
            "tokens": [outputs[i].outputs[0].token_ids for i in [long_id, *ids]]}


def measure(loaded, engine_kwargs: dict, fair_kwargs: dict, long_prompt, shorts, params, repeats: int,
            progress=None) -> dict:
    # Every round sends the same prompts to the same engines: cached prefixes would turn later rounds into hits.
    engine_kwargs = {**engine_kwargs, "enable_prefix_caching": False}
    unfair_kwargs = {**engine_kwargs, "max_num_partial_prefills": 1, "max_long_partial_prefills": 1}
    engines = {
        "alone": LLMEngine(EngineArgs(**unfair_kwargs), loaded=loaded),
        "unfair": LLMEngine(EngineArgs(**unfair_kwargs), loaded=loaded),
        "fair": LLMEngine(EngineArgs(**engine_kwargs, **fair_kwargs), loaded=loaded),
    }
    runs = {
        "alone": lambda: run_alone(engines["alone"], shorts, params),
        "unfair": lambda: run_behind(engines["unfair"], long_prompt, shorts, params),
        "fair": lambda: run_behind(engines["fair"], long_prompt, shorts, params),
    }
    samples = interleaved(runs, repeats, warmup=1, after_each=progress.update if progress else None)
    result = summarize(samples)
    result["fair_long_prefill_token_threshold"] = engines["fair"].scheduler.config.long_prefill_token_threshold
    return result


def summarize(samples: dict[str, list[dict]]) -> dict:
    rows = []
    alone = [s["short_ttft"] for s in samples["alone"]]
    for name in RUNS:
        row = {"run": name}
        put(row, "short_ttft_ms", [s["short_ttft"] for s in samples[name]], scale=1e3)
        put(row, "short_ttft_max_ms", [s["short_ttft_max"] for s in samples[name]], scale=1e3)
        if name != "alone":
            put(row, "long_ttft_ms", [s["long_ttft"] for s in samples[name]], scale=1e3)
            # The multiple of the TTFT alone (a ratio of times: above 1 is longer).
            multiple = verdict([s["short_ttft"] for s in samples[name]], alone)
            row["over_alone"], row["over_alone_spread"] = multiple["ratio"], multiple["ratio_spread"]
        rows.append(row)
    fair = [s["short_ttft"] for s in samples["fair"]]
    unfair = [s["short_ttft"] for s in samples["unfair"]]
    result = {"rows": rows}
    compare(result, "fair_speedup", fair, unfair, higher_is_better=False)
    result["outputs_identical"] = all(a["tokens"] == b["tokens"] for a, b in zip(samples["unfair"], samples["fair"]))
    return result


def cmd_bench_partial_prefills(args) -> int:
    loaded = load_engine_bench(args)
    engine_kwargs = {k: v for k, v in setting_kwargs(args).items()
                     if k not in ("max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold")}
    engine_kwargs["model"] = loaded.source
    fair_kwargs = {k: getattr(args, k) for k in
                   ("max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold")}
    if fair_kwargs["max_num_partial_prefills"] < 2 and fair_kwargs["long_prefill_token_threshold"] is None:
        raise ValueError("the fair run needs --max-num-partial-prefills >= 2 or --long-prefill-token-threshold")
    long_prompt, shorts = make_prompts(loaded.config.vocab_size, args.long_len, args.short_len, args.num_short)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"model: {loaded.config.name}; one {args.long_len}-token prompt, then {args.num_short} of "
          f"{args.short_len} tokens; fair: {fair_kwargs}", file=sys.stderr)
    with progress_bar(len(RUNS) * args.repeats, "runs") as bar:
        result = measure(loaded, engine_kwargs, fair_kwargs, long_prompt, shorts, params, args.repeats, bar)
    result.update({"model": loaded.config.name, "long_len": args.long_len, "short_len": args.short_len,
                   "num_short": args.num_short, "max_tokens": args.max_tokens, "repeats": args.repeats,
                   "engine": {**engine_kwargs, **fair_kwargs}})
    cols = ["run", "short_ttft_ms", "short_ttft_max_ms", "long_ttft_ms", "over_alone"]
    text = "\n".join([
        format_table(result["rows"], cols),
        f"fair over unfair, short-prompt TTFT: {result['fair_speedup']}x {result['fair_speedup_spread']} "
        f"({result['fair_speedup_verdict']}); greedy outputs identical: {result['outputs_identical']}; "
        f"fair long-prefill threshold: {result['fair_long_prefill_token_threshold']}",
    ])
    emit(args, result, text)
    return 0


def add_partial_prefills_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "partial-prefills", help="short prompts' TTFT behind one long prompt, with and without partial prefills",
        description="One long prompt, then short ones: wall-clock TTFT of the short prompts alone, behind the "
                    "long one with one prefill at a time (unfair), and with partial prefills (fair); "
                    "interleaved repeats, median and spread.")
    add_engine_bench_args(p)
    p.add_argument("--long-len", type=int, default=3000, help="tokens of the long prompt (default: 3000)")
    p.add_argument("--short-len", type=int, default=40, help="tokens of each short prompt (default: 40)")
    p.add_argument("--num-short", type=int, default=8, help="short prompts (default: 8)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens each request generates (default: 8)")
    p.add_argument("--repeats", type=int, default=5, help="rounds of the three runs, after one warm-up (default: 5)")
    add_setting_args(p, ["chunk_size", "max_num_seqs", "token_budget_mode", "max_num_partial_prefills",
                         "max_long_partial_prefills", "long_prefill_token_threshold"], overrides={
        "max_num_partial_prefills": dict(default=4, help="the fair run's partial prefills (default: 4)")})
    p.set_defaults(func=cmd_bench_partial_prefills)
