"""`charioteer bench prefix-caching`: many requests behind one long shared system prompt, with and
without prefix caching.

Each round draws a new system prompt (so every round starts with a cold cache) and N requests,
each the system prompt plus a question of its own, queued at once. Two engines serve the same
requests, interleaved round by round (off, on, off, on, ...): one without prefix caching, one with
it. Reported per run: the requests' TTFT (median over requests, per round; then median and spread
over rounds), their p90 TTFT, the prompt tokens actually prefilled, and generated tokens per second
over the whole batch. Greedy outputs of the two runs are compared token by token.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from charioteer.bench.common import add_engine_bench_args, emit, format_table, load_engine_bench, progress_bar
from charioteer.bench.stats import compare, interleaved, median, put
from charioteer.config import EngineArgs, add_setting_args, setting_kwargs
from charioteer.engine.llm_engine import LLMEngine
from charioteer.request import SamplingParams

RUNS = ("off", "on")


def make_round(vocab: int, prefix_len: int, suffix_len: int, num_requests: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(1, vocab, prefix_len).tolist()
    return [system + rng.integers(1, vocab, suffix_len).tolist() for _ in range(num_requests)]


def run_round(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    prefilled = []
    unsubscribe = engine.subscribe(lambda record: prefilled.append(record.num_prefill_tokens))
    start = time.monotonic()
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    wall = time.monotonic() - start
    unsubscribe()
    ttfts = sorted(outputs[i].metrics.first_token_time - outputs[i].metrics.arrival_time for i in ids)
    generated = sum(len(outputs[i].outputs[0].token_ids) for i in ids)
    return {"ttft": median(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))], "tok_s": generated / wall,
            "prefilled": sum(prefilled), "tokens": [outputs[i].outputs[0].token_ids for i in ids]}


def measure(loaded, engine_kwargs: dict, make_prompts, params, repeats: int, progress=None) -> dict:
    engines = {name: LLMEngine(EngineArgs(**engine_kwargs, enable_prefix_caching=name == "on"), loaded=loaded)
               for name in RUNS}
    rounds = {name: 0 for name in RUNS}

    def run(name: str):
        rounds[name] += 1  # both runs of a round see the same requests; each round a new system prompt
        return run_round(engines[name], make_prompts(rounds[name]), params)

    samples = interleaved({name: (lambda name=name: run(name)) for name in RUNS}, repeats, warmup=1,
                          after_each=progress.update if progress else None)
    rows = []
    for name in RUNS:
        row = {"run": name}
        put(row, "ttft_ms", [s["ttft"] for s in samples[name]], scale=1e3)
        put(row, "ttft_p90_ms", [s["ttft_p90"] for s in samples[name]], scale=1e3)
        put(row, "tok_s", [s["tok_s"] for s in samples[name]])
        row["prefilled_tokens"] = median(s["prefilled"] for s in samples[name])
        rows.append(row)
    result = {"rows": rows}
    compare(result, "ttft_speedup", [s["ttft"] for s in samples["on"]], [s["ttft"] for s in samples["off"]],
            higher_is_better=False)
    compare(result, "throughput_gain", [s["tok_s"] for s in samples["on"]], [s["tok_s"] for s in samples["off"]])
    result["outputs_identical"] = all(a["tokens"] == b["tokens"] for a, b in zip(samples["off"], samples["on"]))
    return result


def cmd_bench_prefix_caching(args) -> int:
    loaded = load_engine_bench(args)
    engine_kwargs = {k: v for k, v in setting_kwargs(args).items() if k != "enable_prefix_caching"}
    engine_kwargs["model"] = loaded.source
    vocab = loaded.config.vocab_size
    make_prompts = lambda seed: make_round(vocab, args.prefix_len, args.suffix_len, args.num_requests, seed)  # noqa: E731
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"model: {loaded.config.name}; {args.num_requests} requests of a {args.prefix_len}-token shared "
          f"prompt + {args.suffix_len} tokens each, {args.max_tokens} generated", file=sys.stderr)
    with progress_bar(len(RUNS) * args.repeats, "runs") as bar:
        result = measure(loaded, engine_kwargs, make_prompts, params, args.repeats, bar)
    result.update({"model": loaded.config.name, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
                   "num_requests": args.num_requests, "max_tokens": args.max_tokens, "repeats": args.repeats,
                   "engine": engine_kwargs})
    text = "\n".join([
        format_table(result["rows"], ["run", "ttft_ms", "ttft_p90_ms", "tok_s", "prefilled_tokens"]),
        f"caching on over off: TTFT {result['ttft_speedup']}x {result['ttft_speedup_spread']} "
        f"({result['ttft_speedup_verdict']}), throughput {result['throughput_gain']}x "
        f"{result['throughput_gain_spread']} ({result['throughput_gain_verdict']}); greedy outputs identical: "
        f"{result['outputs_identical']}",
    ])
    emit(args, result, text)
    return 0


def add_prefix_caching_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "prefix-caching", help="requests sharing one long system prompt, with and without prefix caching",
        description="N requests of one shared system prompt plus their own question, queued at once: TTFT and "
                    "throughput without and with prefix caching; interleaved repeats, median and spread.")
    add_engine_bench_args(p)
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens of the shared system prompt (default: 1024)")
    p.add_argument("--suffix-len", type=int, default=32, help="tokens of each request's own part (default: 32)")
    p.add_argument("--num-requests", type=int, default=16, help="requests per round (default: 16)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates (default: 16)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the two runs, after one warm-up (default: 3)")
    add_setting_args(p, ["chunk_size", "max_num_seqs", "token_budget_mode", "block_size"])
    p.set_defaults(func=cmd_bench_prefix_caching)
