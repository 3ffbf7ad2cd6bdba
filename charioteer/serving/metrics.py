"""Prometheus metrics, named after vLLM's (`vllm:` becomes `charioteer:`).

Per iteration, from the engine's step records (`AsyncEngine._observe_step`):
  charioteer:iteration_tokens_total            = vllm:iteration_tokens_total (tokens per engine step)
  charioteer:iteration_prefill_tokens          prompt tokens per step, 0 in decode-only steps; vLLM has
                                               no such histogram (its nearest: the prompt_tokens counter)
  charioteer:iteration_decode_tokens           decode tokens per step, 0 in prefill-only steps; vLLM has
                                               none (nearest: the generation_tokens counter)
  charioteer:iteration_duration_seconds{kind}  wall time of a step, kind = prefill, decode or mixed
                                               (StepRecord.kind); vLLM has none
  charioteer:prefix_cache_queries_total        = vllm:prefix_cache_queries (prompt tokens looked up)
  charioteer:prefix_cache_hits_total           = vllm:prefix_cache_hits (of those, tokens found cached)
  charioteer:token_budget                      the token budget (SARATHI's chunk size C) of the last step;
                                               moves under --tbt-slo-ms; vLLM has none
  charioteer:tbt_p99_seconds                   p99 time between tokens over the last 512 gaps, from the
                                               step records (what --tbt-slo-ms holds); vLLM has none
Each of the three new histograms observes every step once, so their counts equal the number of
steps and their sums the tokens (or seconds) the steps ran.

Each server gets its own registry, so several servers can live in one process (tests).
prometheus-client metrics are thread-safe: the engine thread updates them directly.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
ITERATION_PART_BUCKETS = [0] + ITERATION_BUCKETS  # 0: a step without prompt (or decode) tokens
ITERATION_TIME_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                          1.0, 2.5, 5.0, 10.0]
STEP_KINDS = ("prefill", "decode", "mixed")


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        label = ["model_name"]

        def gauge(name, doc):
            return Gauge(f"charioteer:{name}", doc, label, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"charioteer:{name}", doc, label, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"charioteer:{name}", doc, label, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch set.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (includes preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self.preemptions = counter("num_preemptions", "Preemptions by recompute (KV cache exhausted).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    REQUEST_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens (prompt + decode) per engine step.",
                                          ITERATION_BUCKETS)
        self.iteration_prefill_tokens = histogram(
            "iteration_prefill_tokens", "Prompt tokens (chunks and recomputes) per engine step; 0 if none.",
            ITERATION_PART_BUCKETS)
        self.token_budget = gauge("token_budget", "Token budget (SARATHI's chunk size) of the last engine step.")
        self.tbt_p99 = gauge("tbt_p99_seconds", "p99 time between tokens over the last 512 gaps.")
        self.iteration_decode_tokens = histogram(
            "iteration_decode_tokens", "Decode tokens per engine step; 0 if none.", ITERATION_PART_BUCKETS)
        duration = Histogram("charioteer:iteration_duration_seconds",
                             "Wall time of an engine step, by kind: prefill (prompt tokens only), decode "
                             "(decodes only) or mixed.", ["model_name", "kind"], buckets=ITERATION_TIME_BUCKETS,
                             registry=r)
        self.iteration_duration = {kind: duration.labels(model_name, kind) for kind in STEP_KINDS}
        self._success = Counter("charioteer:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prefix cache queries, in prompt tokens looked up at admission.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached.")
        self.aborted = counter("num_requests_aborted", "Requests aborted (client gone or server error).")
        self.rejected = counter("num_requests_rejected", "Requests refused because the queue was full.")

    def success(self, reason: str) -> None:
        self._success.labels(self._model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
