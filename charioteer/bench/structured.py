"""`charioteer bench structured`: what structured outputs cost in throughput.

Workload A of `bench peers` (16 chat prompts, 64 new tokens each, greedy, EOS ignored) runs on one
engine two ways, interleaved (A B A B): unconstrained, and with every other request held to a
JSON schema. The schema's shortest output is longer than 64 tokens, so the constrained requests
also run exactly 64 tokens: both ways do the same model work, and the difference is the grammar's
(the token bitmask each step, the masked copy of the constrained rows, advancing the matchers).
The grammar is compiled before timing, as the server compiles it before a request is queued; the
first (cold) compile is reported on its own.
"""
from __future__ import annotations

import sys
import time

from charioteer.bench.common import add_engine_bench_args, emit, format_table, load_engine_bench, model_dtype
from charioteer.bench.peers import workload_a
from charioteer.bench.stats import compare, interleaved, put
from charioteer.config import setting_kwargs

# 32 one-digit scores alone take 64 tokens (SmolLM2 splits digits, so a digit and its comma are two).
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 80},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 4, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 32, "maxItems": 32},
    },
    "required": ["answer", "keywords", "scores"],
}
TARGET_LOSS = 0.10  # issue 21: at most 10 % throughput lost with half the requests constrained
MIXES = ("unconstrained", "half_constrained")


def measure(llm, repeats: int, warmup: int = 1) -> dict:
    from charioteer.request import SamplingParams, StructuredOutputsParams

    work = workload_a(llm.tokenizer)
    plain = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    spec = StructuredOutputsParams(json=BENCH_SCHEMA)
    held = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, structured_outputs=spec)
    start = time.perf_counter()
    llm.engine.structured_outputs.compile(spec)
    first_compile_s = time.perf_counter() - start
    params = {"unconstrained": [plain] * len(work.prompts),
              "half_constrained": [held if i % 2 else plain for i in range(len(work.prompts))]}
    outputs: dict[str, list] = {}

    def run(mix: str):
        begin = time.perf_counter()
        outs = llm.generate(work.prompts, params[mix])
        elapsed = time.perf_counter() - begin
        outputs[mix] = outs
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed

    samples = interleaved({mix: (lambda mix=mix: run(mix)) for mix in MIXES}, repeats, warmup)
    result = {"first_compile_s": round(first_compile_s, 3), "repeats": repeats,
              "requests": len(work.prompts), "constrained_requests": len(work.prompts) // 2,
              "max_tokens": 64, "rows": []}
    for mix in MIXES:
        row = {"mix": mix}
        put(row, "tokens_per_s", samples[mix], digits=1)
        result["rows"].append(row)
    compare(result, "constrained_over_unconstrained", samples["half_constrained"], samples["unconstrained"])
    result["loss"] = round(1 - result["constrained_over_unconstrained"], 3)
    result["within_target"] = result["loss"] <= TARGET_LOSS
    # Same work both ways, and the unconstrained half unchanged by its constrained neighbours.
    a, b = outputs["unconstrained"], outputs["half_constrained"]
    result["same_token_counts"] = [len(o.outputs[0].token_ids) for o in a] == [len(o.outputs[0].token_ids) for o in b]
    result["unconstrained_half_unchanged"] = all(a[i].outputs[0].token_ids == b[i].outputs[0].token_ids
                                                 for i in range(0, len(a), 2))
    return result


def cmd_bench_structured(args) -> int:
    import torch

    from charioteer.engine.llm import LLM

    loaded = load_engine_bench(args)
    settings = {k: v for k, v in setting_kwargs(args).items() if k != "model"}
    # Every round resends workload A's prompts to this engine: no prefix caching, or later rounds would hit it.
    llm = LLM(loaded, enable_prefix_caching=False, **settings,
              **workload_a(loaded.tokenizer).engine_args["charioteer-sarathi"])
    precision = {"dtype": model_dtype(args), "quantization": args.quantization}
    print(f"model: {llm.engine.model_config.name}, {args.device}, {precision['dtype']}"
          f"{', ' + args.quantization if args.quantization else ''}, {torch.get_num_threads()} threads; workload A, "
          f"{args.repeats} rounds after {args.warmup} warm-up", file=sys.stderr)
    result = {**measure(llm, args.repeats, args.warmup), **precision}
    text = "\n".join([
        format_table(result["rows"], ["mix", "tokens_per_s"]),
        f"half constrained / unconstrained: {result['constrained_over_unconstrained']} "
        f"{result['constrained_over_unconstrained_spread']} ({result['constrained_over_unconstrained_verdict']}); "
        f"loss {result['loss'] * 100:.1f} % (target <= {TARGET_LOSS * 100:.0f} %: "
        f"{'met' if result['within_target'] else 'missed'})",
        f"first grammar compile (cold: xgrammar import and vocabulary): {result['first_compile_s']} s; "
        f"same token counts: {result['same_token_counts']}; unconstrained half unchanged: "
        f"{result['unconstrained_half_unchanged']}",
    ])
    emit(args, result, text)
    return 0


def add_structured_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "structured", help="throughput of workload A with half its requests held to a JSON schema",
        description="Workload A (16 chat prompts x 64 tokens) unconstrained, and with every other request "
                    "constrained by a JSON schema (xgrammar), interleaved; tokens/s median and spread, and the loss.")
    add_engine_bench_args(p)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds, each running both mixes (default: 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default: 1)")
    p.set_defaults(func=cmd_bench_structured)
