"""OpenAI-compatible HTTP server for Charioteer: `charioteer serve`.

- `async_engine.AsyncEngine` runs an LLMEngine in its own thread and hands outputs to asyncio.
- `protocol` parses and validates request bodies and builds the response bodies and OpenAI-style errors.
- `api.build_app` is the FastAPI application; `metrics.ServerMetrics` its Prometheus metrics.
- `cli.add_serve_parser` adds the `serve` subcommand to the charioteer command line.
"""
