"""`charioteer bench switch`: a fast path against the path its environment switch forces, in one run.

Every fast path has a switch that forces the portable one (CHARIOTEER_VNNI=0, CHARIOTEER_GGUF_KERNEL=0,
...). This builds two engines in one process, one with the switch on and one with it off, and runs
the same batch of greedy requests on each, interleaved (on, off, on, off, ...) after a warm-up round.
It reports each one's generated tokens per second with their spread, the ratio with its verdict,
which kernel choices the switch changed (`llama.Kernels`), and whether the two gave the same tokens.
Only switches read when an engine is built take effect; one read once per process (the ISA,
CHARIOTEER_CPU_KERNELS) changes nothing here, and the empty `kernels_changed` says so.
"""
from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from charioteer.bench.common import add_engine_bench_args, emit, load_engine_bench, progress_bar
from charioteer.bench.roofline import cpu_features, cpu_model
from charioteer.bench.stats import cell, compare, interleaved, put
from charioteer.config import setting_kwargs
from charioteer.engine.llm import LLM
from charioteer.request import SamplingParams

SWITCH_PREFIX = "CHARIOTEER_"


def engines_with_switch(loaded, engine_kwargs: dict, switch: str, values: dict[str, str]) -> dict[str, LLM]:
    """One engine per state, built with `switch` set to that state's value; the environment is restored after."""
    before = os.environ.get(switch)
    engines = {}
    try:
        for state, value in values.items():
            os.environ[switch] = value
            engines[state] = LLM(loaded, **engine_kwargs)
    finally:
        if before is None:
            os.environ.pop(switch, None)
        else:
            os.environ[switch] = before
    return engines


def measure(engines: dict[str, LLM], prompts: list[list[int]], new_tokens: int, repeats: int, progress=None) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    tokens = {}

    def run(state: str) -> float:
        start = time.perf_counter()
        outputs = engines[state].generate(prompts, params)
        elapsed = time.perf_counter() - start
        tokens[state] = [list(o.outputs[0].token_ids) for o in outputs]
        return len(prompts) * new_tokens / elapsed

    samples = interleaved({state: (lambda s=state: run(s)) for state in engines}, repeats, warmup=1,
                          after_each=progress.update if progress else None)
    result: dict = {}
    for state in engines:
        put(result, f"{state}_tok_s", samples[state], digits=1)
    compare(result, "on_over_off", samples["on"], samples["off"])
    result["same_tokens"] = tokens["on"] == tokens["off"]
    on, off = (dataclasses.asdict(engines[s].engine.model.kernels) for s in ("on", "off"))
    result["kernels_changed"] = {name: [on[name], off[name]] for name in on if on[name] != off[name]}
    return result


def cmd_bench_switch(args) -> int:
    if not args.env.startswith(SWITCH_PREFIX) or args.env == SWITCH_PREFIX:
        raise ValueError(f"--env must name one of Charioteer's switches ({SWITCH_PREFIX}...), got {args.env!r}")
    if args.on == args.off:
        raise ValueError(f"--on and --off must differ, both are {args.on!r}")
    if args.requests < 1 or args.prompt_len < 1 or args.new_tokens < 1:
        raise ValueError("--requests, --prompt-len and --new-tokens must be >= 1")
    loaded = load_engine_bench(args)
    engine_kwargs = {**setting_kwargs(args), "max_num_seqs": args.requests, "enable_prefix_caching": False}
    engine_kwargs.pop("model", None)
    engines = engines_with_switch(loaded, engine_kwargs, args.env, {"on": args.on, "off": args.off})
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(1, loaded.config.vocab_size, args.prompt_len).tolist() for _ in range(args.requests)]
    with progress_bar(2 * args.repeats, "runs") as bar:
        result = measure(engines, prompts, args.new_tokens, args.repeats, bar)
    result.update({"env": args.env, "on": args.on, "off": args.off, "model": loaded.config.name,
                   "requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   "repeats": args.repeats, "cpu": cpu_model(), "cpu_features": cpu_features(), "engine": engine_kwargs})
    changed = ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in result["kernels_changed"].items()) or "none"
    text = "\n".join([
        f"{cpu_model()} ({'+'.join(cpu_features())}); {loaded.config.name}, {args.requests} requests of "
        f"{args.prompt_len} prompt tokens generating {args.new_tokens}",
        f"{args.env}={args.on}: {cell(result, 'on_tok_s')} tok/s; {args.env}={args.off}: {cell(result, 'off_tok_s')}",
        f"on over off: {result['on_over_off']}x {result['on_over_off_spread']} ({result['on_over_off_verdict']}); "
        f"same tokens: {result['same_tokens']}; kernels changed (on -> off): {changed}"])
    emit(args, result, text)
    return 0


def add_switch_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "switch", help="a fast path against the portable path its environment switch forces, interleaved",
        description="Two engines in one process, --env set to --on for one and --off for the other, the "
                    "same greedy requests run on each in turn: tokens per second with their spread, the "
                    "ratio, the kernel choices the switch changed, and whether the tokens are the same.")
    add_engine_bench_args(p)
    p.add_argument("--env", required=True, help="the switch, e.g. CHARIOTEER_VNNI or CHARIOTEER_GGUF_KERNEL")
    p.add_argument("--on", default="1", help="its value for the first engine (default: 1)")
    p.add_argument("--off", default="0", help="its value for the second engine (default: 0)")
    p.add_argument("--requests", type=int, default=16, help="requests per run, all at once (default: 16)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each (default: 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens each generates (default: 64)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each engine, after one warm-up (default: 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    p.set_defaults(func=cmd_bench_switch)
