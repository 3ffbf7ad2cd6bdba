"""`charioteer serve`: wire with `add_serve_parser(sub)` in charioteer.cli.build_parser."""
from __future__ import annotations

import argparse
import os

from charioteer.config import EngineArgs, add_setting_args


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="run an OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serve the model over HTTP with OpenAI's API: POST /v1/completions, "
                    "POST /v1/chat/completions (both with SSE streaming), vLLM's POST /tokenize and "
                    "/detokenize, GET /v1/models, /health and /metrics (Prometheus). The engine steps in "
                    "its own thread.")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait beyond the --max-num-seqs running ones; past that the server "
                        "answers 503 with Retry-After (default: 256)")
    s.add_argument("--api-key", default=os.environ.get("CHARIOTEER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $CHARIOTEER_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: the --model value, smollm2-135m; the "
                        "model's own name is accepted too)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default: 1 MiB)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--trace-steps", default=None, metavar="FILE",
                   help="write every step record to FILE as a JSON line, as it happens (for `charioteer view`, or "
                        "to fit the simulator's cost model on served steps, as `bench search-check` does)")
    add_setting_args(p.add_argument_group("engine"))
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    engine_args = EngineArgs.from_args(args)  # bad settings fail before the model loads
    # Line-buffered: each step's line is in the file as soon as the step ends.
    trace_file = open(args.trace_steps, "w", encoding="utf-8", buffering=1) if args.trace_steps else None
    import uvicorn
    from prometheus_client import disable_created_metrics

    from charioteer.engine.llm_engine import LLMEngine
    from charioteer.engine.trace import TraceRecorder
    from charioteer.serving.api import ServerConfig, build_app

    disable_created_metrics()  # no `*_created` series next to every counter and histogram
    engine = LLMEngine(engine_args)
    # Clients name the model as it was given to --model (smollm2-135m by default); the model's
    # own name (GGUF general.name) is accepted too.
    name = args.served_model_name or args.model or "smollm2-135m"
    app = build_app(engine, ServerConfig(
        model_name=name, aliases=(engine.model_config.name,), api_key=args.api_key,
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
    ))
    trace = TraceRecorder(engine, trace_file) if trace_file else None
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()  # pipeline stage processes, if any
        if trace is not None:
            trace.close()
            trace_file.close()
    return 0
