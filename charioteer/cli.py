"""Command line: `charioteer <command> --help` documents each command."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from charioteer.bench.cli import add_bench_parser
from charioteer.bench.paper_cli import add_profile_parser
from charioteer.config import EngineArgs, add_setting_args, setting_kwargs
from charioteer.serving.cli import add_serve_parser
from charioteer.sim.cli import add_simulate_parser
from charioteer.tune.cli import add_tune_parser

# Errors that mean "change the command line or the files it names", reported in one line with
# exit status 2. Anything else (a bug) keeps its traceback, as does Ctrl-C;
# CHARIOTEER_TRACEBACK=1 shows the traceback of these too.
EXPECTED_ERRORS = (ValueError, OSError, RuntimeError)


def cmd_generate(args: argparse.Namespace) -> int:
    EngineArgs.from_args(args)  # bad settings fail here, before torch is imported
    from charioteer.engine.llm import LLM
    from charioteer.request import SamplingParams

    from charioteer.engine.trace import TraceRecorder

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    trace_file = open(args.trace, "w", encoding="utf-8") if args.trace else None  # fails before the model loads
    llm = LLM(**setting_kwargs(args))
    engine = llm.engine
    recorder = TraceRecorder(engine, trace_file) if trace_file else None
    prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    request_id = engine.add_request(prompt, params, stream=True)
    start = time.perf_counter()
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                final = out
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    if recorder is not None:
        recorder.close()
        trace_file.close()
        print(f"charioteer: wrote {recorder.count} step records to {args.trace} (charioteer view {args.trace})",
              file=sys.stderr)
    if args.stats and final is not None:
        n = len(final.outputs[0].token_ids)
        stats = {
            "prompt_tokens": len(final.prompt_token_ids), "generated_tokens": n,
            "seconds": round(elapsed, 3), "tokens_per_s": round(n / elapsed, 1),
            "finish_reason": final.outputs[0].finish_reason, "capacity": engine.capacity(),
        }
        print(json.dumps(stats), file=sys.stderr)
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    from charioteer.engine.trace import load_trace
    from charioteer.serving.dashboard import render_html

    out = args.output or os.path.splitext(args.trace)[0] + ".html"
    if os.path.abspath(out) == os.path.abspath(args.trace):
        raise ValueError(f"the output {out} would overwrite the trace; give another with -o")
    records = load_trace(args.trace)
    html = render_html(records, os.path.basename(args.trace))
    with open(out, "w", encoding="utf-8") as f:
        f.write(html)
    print(f"wrote {out}: {len(records)} iterations; open it in a browser")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_args(args)  # bad settings fail here, before torch is imported
    from charioteer.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_args)
    c = engine.model_config
    info = {"model": c.name, "layers": c.num_layers, "hidden_size": c.hidden_size, "heads": c.num_heads,
            "kv_heads": c.num_kv_heads, "vocab_size": c.vocab_size, "parameters": c.num_parameters,
            "has_tokenizer": engine.tokenizer is not None, **engine.capacity()}
    print(json.dumps(info, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="charioteer",
        description="LLM inference with SARATHI's chunked prefills and decode-maximal batching.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal",
                         description="Generate text for one prompt and stream it as it is produced.")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--stats", action="store_true", help="print token counts and tokens/s as JSON on stderr")
    gen.add_argument("--trace", metavar="FILE", default=None,
                     help="write every iteration's step record to FILE as JSON lines (see `charioteer view`)")
    add_setting_args(gen.add_argument_group("engine"))
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="describe a model and its KV capacity (the paper's batch capacity B)",
                          description="Load a model and print its shape, KV cache size and batch capacity B.")
    add_setting_args(info.add_argument_group("engine"))
    info.set_defaults(func=cmd_info)

    view = sub.add_parser("view", help="turn a --trace file into a self-contained HTML dashboard",
                          description="Write the dashboard page (what `serve` shows at /dashboard) with a trace's "
                                      "iterations embedded: it opens in a browser without a server.")
    view.add_argument("trace", help="a file from `generate --trace` or TraceRecorder (JSON lines or a JSON array)")
    view.add_argument("-o", "--output", default=None, help="the HTML file (default: the trace's name with .html)")
    view.set_defaults(func=cmd_view)

    add_serve_parser(sub)
    add_simulate_parser(sub)
    add_profile_parser(sub)
    add_tune_parser(sub)
    add_bench_parser(sub)
    return parser


def error_line(exc: BaseException) -> str:
    """An expected error as one line: its message (newlines folded), or its type if it has none."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"charioteer: error: {text or type(exc).__name__}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EXPECTED_ERRORS as exc:
        if os.environ.get("CHARIOTEER_TRACEBACK") == "1":
            raise
        print(error_line(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
