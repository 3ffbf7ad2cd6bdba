"""`charioteer bench serve` / `bench capacity`: drive an OpenAI-compatible server and measure latency.

The client streams every request (`stream: true`, `stream_options.include_usage`) with httpx and
timestamps every SSE chunk. From those it reports what `vllm bench serve` reports: request and
token throughput, and mean / median / p99 of TTFT, TPOT, ITL and end-to-end latency in ms.

- TTFT: send -> first chunk with content.
- ITL: the gaps between successive content chunks (TBT in the Sarathi papers).
- TPOT: (e2e - ttft) / (output_tokens - 1), per request with more than one output token.
- E2E: send -> the stream's end.
Output tokens are the server's count, from the final usage chunk.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import numpy as np

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


# ---- workload -----------------------------------------------------------------------------


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (exact input length)
    prompt_len: int  # tokens (for text prompts: an estimate)
    output_len: int  # max_tokens


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int | None = 0) -> np.ndarray:
    """Send times (s, from the start) of n requests at `rate` requests/s.

    Inter-arrival gaps are gamma-distributed with shape=burstiness and mean 1/rate: burstiness 1
    is a Poisson process, < 1 is burstier, > 1 more regular. rate = inf sends everything at 0.
    """
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps)


def _lengths(rng: np.random.Generator, n: int, dist: str, mean: int, lo: int | None, hi: int | None,
             zipf_a: float) -> np.ndarray:
    lo = max(1, lo if lo is not None else (mean if dist == "fixed" else max(1, mean // 2)))
    hi = hi if hi is not None else (mean if dist == "fixed" else mean * 3 // 2)
    if hi < lo:
        raise ValueError(f"length range is empty: [{lo}, {hi}]")
    if dist == "uniform":
        return rng.integers(lo, hi + 1, size=n)
    if dist == "zipf":  # heavy-tailed: most prompts near `lo`, a few long ones, clipped to `hi`
        return np.clip(lo - 1 + rng.zipf(zipf_a, size=n), lo, hi)
    if dist == "fixed":
        return np.full(n, mean)
    raise ValueError(f"unknown length distribution {dist!r}")


def synthetic_requests(n: int, input_len: int = 128, output_len: int = 32, input_dist: str = "uniform",
                       input_min: int | None = None, input_max: int | None = None,
                       output_dist: str = "fixed", output_min: int | None = None, output_max: int | None = None,
                       zipf_a: float = 1.5, token_id_range: tuple[int, int] = (1000, 20000),
                       seed: int | None = 0) -> list[BenchRequest]:
    """Prompts of random token ids (exact input lengths, no tokenizer needed on the client)."""
    rng = np.random.default_rng(seed)
    ins = _lengths(rng, n, input_dist, input_len, input_min, input_max, zipf_a)
    outs = _lengths(rng, n, output_dist, output_len, output_min, output_max, zipf_a)
    lo, hi = token_id_range
    return [BenchRequest([int(t) for t in rng.integers(lo, hi, size=int(i))], int(i), int(o))
            for i, o in zip(ins, outs)]


def _approx_tokens(text: str) -> int:
    return max(1, round(len(text) / 4))  # ~4 characters a token for English BPE vocabularies


def load_sharegpt(path: str, n: int | None = None, seed: int | None = 0, output_len: int | None = None,
                  max_input_len: int | None = None, max_output_len: int | None = None,
                  shuffle: bool = True) -> list[BenchRequest]:
    """ShareGPT JSON: a list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}.

    Each conversation's first human turn is a prompt; the reply that follows sets max_tokens (its
    length in tokens, estimated at 4 characters a token) unless `output_len` fixes it.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    out: list[BenchRequest] = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if first.get("from") not in ("human", "user") or not isinstance(first.get("value"), str):
            continue
        prompt, reply = first["value"], second.get("value")
        if not prompt.strip() or not isinstance(reply, str):
            continue
        plen = _approx_tokens(prompt)
        olen = output_len if output_len is not None else _approx_tokens(reply)
        if max_input_len is not None and plen > max_input_len:
            continue
        if max_output_len is not None:
            olen = min(olen, max_output_len)
        out.append(BenchRequest(prompt, plen, max(1, olen)))
    if not out:
        raise ValueError(f"{path}: no usable conversations (a human turn followed by a reply)")
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(out))
        out = [out[i] for i in order]
    if n is not None:
        if n > len(out):  # cycle through the file
            out = [out[i % len(out)] for i in range(n)]
        out = out[:n]
    return out


# ---- client -------------------------------------------------------------------------------


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # s
    e2el: float = 0.0  # s
    itl: list[float] = field(default_factory=list)  # s, gaps between content chunks
    start: float = 0.0  # s since the run began


async def _one_request(client, url: str, model: str, req: BenchRequest, headers: dict, t0: float,
                       ignore_eos: bool, temperature: float) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM / charioteer extension, not OpenAI's
    res = RequestResult(prompt_len=req.prompt_len)
    start = time.perf_counter()
    res.start = start - t0
    last = None
    usage = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))
                    return res
                if obj.get("usage"):
                    usage = obj["usage"]
                choices = obj.get("choices") or []
                if any((c.get("text") or (c.get("delta") or {}).get("content")) for c in choices):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2el = time.perf_counter() - start
        if usage is None:
            res.error = "no usage chunk in the stream (does the server honour stream_options.include_usage?)"
            return res
        res.output_tokens = int(usage.get("completion_tokens") or 0)
        res.prompt_len = int(usage.get("prompt_tokens") or req.prompt_len)
        if last is None:  # nothing generated: first token time = end
            res.ttft = res.e2el
        res.success = True
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_requests(base_url: str, model: str, requests: list[BenchRequest], rate: float = math.inf,
                       burstiness: float = 1.0, max_concurrency: int | None = None, seed: int | None = 0,
                       api_key: str | None = None, ignore_eos: bool = False, temperature: float = 0.0,
                       timeout: float = 600.0, progress: bool = True, endpoint: str = "/v1/completions",
                       offsets: np.ndarray | None = None) -> tuple[list[RequestResult], float]:
    """Send `requests` at their arrival times (`offsets`, s from the start; default: drawn at `rate`); returns
    the per-request results and the duration (s)."""
    import httpx

    if offsets is None:
        offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    elif len(offsets) != len(requests):
        raise ValueError(f"{len(offsets)} arrival offsets for {len(requests)} requests")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    url = base_url.rstrip("/") + endpoint
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), file=sys.stderr, desc="requests", leave=False)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        t0 = time.perf_counter()

        async def fire(i: int, req: BenchRequest) -> RequestResult:
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                r = await _one_request(client, url, model, req, headers, t0, ignore_eos, temperature)
            else:
                async with sem:
                    r = await _one_request(client, url, model, req, headers, t0, ignore_eos, temperature)
            if bar is not None:
                bar.update(1)
            return r

        results = await asyncio.gather(*(fire(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return list(results), duration


# ---- metrics ------------------------------------------------------------------------------


def _stats(values_s: list[float], name: str) -> dict:
    ms = np.asarray(values_s, dtype=float) * 1000.0
    d = {f"mean_{name}_ms": float(ms.mean()) if ms.size else 0.0,
         f"median_{name}_ms": float(np.median(ms)) if ms.size else 0.0,
         f"std_{name}_ms": float(ms.std()) if ms.size else 0.0}
    for p in PERCENTILES:
        d[f"p{p}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return d


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.e2el for r in ok],
    }


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    m = {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
    }
    samples = latency_samples(results)
    for name in METRICS:
        m.update(_stats(samples[name], name))
    errors = [r.error for r in results if not r.success]
    if errors:
        m["errors"] = errors[:10]
    return m


def format_report(m: dict, title: str = "Serving Benchmark Result") -> str:
    lines = [f"{'=' * 18} {title} {'=' * 18}"]
    w = len(lines[0])

    def row(label, value, fmt="{:.2f}"):
        v = fmt.format(value) if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{v:>{w - 40}}")

    row("Successful requests:", m["successful_requests"])
    row("Failed requests:", m["failed_requests"])
    if m.get("request_rate") is not None:
        row("Request rate (req/s):", str(m["request_rate"]))
    if m.get("max_concurrency"):
        row("Maximum request concurrency:", m["max_concurrency"])
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in METRICS:
        lines.append(f"{titles[name]:-^{w}}")
        row(f"Mean {name.upper()} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", m[f"median_{name}_ms"])
        row(f"P99 {name.upper()} (ms):", m[f"p99_{name}_ms"])
    lines.append("=" * w)
    return "\n".join(lines)


def write_outputs(out_dir: str, metrics: dict, results: list[RequestResult]) -> list[str]:
    """results.json (metrics + per-request records) and one latency CDF plot per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "results.json")]
    with open(paths[0], "w") as f:
        json.dump({**metrics, "requests": [asdict(r) for r in results]}, f, indent=1)
    samples = latency_samples(results)
    labels = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL (TBT)", "e2el": "end-to-end latency"}
    for name in METRICS:
        ms = np.sort(np.asarray(samples[name]) * 1000.0)
        fig, ax = plt.subplots(figsize=(6, 4))
        if ms.size:
            ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post")
            ax.axvline(np.percentile(ms, 99), color="red", ls="--", lw=0.8, label="p99")
            ax.legend(loc="lower right")
        ax.set_xlabel(f"{labels[name]} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{labels[name]} CDF (n={ms.size})")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, f"cdf_{name}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# ---- a server of our own ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`charioteer serve` in a subprocess on 127.0.0.1; always killed on exit (with its process group).

    `cpus` pins it to those cores, with that many torch threads, so a client on the other cores does not
    slow the server it measures."""

    def __init__(self, serve_args: list[str], startup_timeout: float = 300.0, log_level: str = "warning",
                 cpus: set[int] | None = None) -> None:
        self.cpus = cpus
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "charioteer.cli", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port), "--log-level", log_level, *serve_args]
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "ServerProcess":
        import httpx

        env, pin = None, None
        if self.cpus:
            cpus = set(self.cpus)
            env = dict(os.environ, OMP_NUM_THREADS=str(len(cpus)))
            pin = lambda: os.sched_setaffinity(0, cpus)  # noqa: E731 - runs in the child before exec
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True, env=env, preexec_fn=pin)
        deadline = time.monotonic() + self.startup_timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{err[-2000:]}")
                try:
                    if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not become healthy within {self.startup_timeout:.0f}s")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        # Drain stderr in the background so a chatty server never blocks on a full pipe.
        import threading

        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        with contextlib.suppress(Exception):
            for _ in self.proc.stderr:
                pass

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


ENGINE_FLAGS = (  # (attribute, flag) forwarded to `charioteer serve`
    ("model", "--model"), ("num_layers", "--num-layers"), ("scheduler", "--scheduler"),
    ("chunk_size", "--chunk-size"), ("tbt_slo_ms", "--tbt-slo-ms"), ("max_num_seqs", "--max-num-seqs"),
    ("max_num_batched_tokens", "--max-num-batched-tokens"), ("tile_size", "--tile-size"),
    ("kv_policy", "--kv-policy"), ("kv_cache_memory_gb", "--kv-cache-memory-gb"),
    ("max_model_len", "--max-model-len"), ("device", "--device"), ("dtype", "--dtype"),
    ("quantization", "--quantization"),
)


def serve_args_from(args) -> list[str]:
    out: list[str] = []
    for attr, flag in ENGINE_FLAGS:
        v = getattr(args, attr, None)
        if v is not None:
            out += [flag, str(v)]
    if getattr(args, "token_budget_mode", False):
        out.append("--token-budget-mode")
    if getattr(args, "server_args", None):
        out += shlex.split(args.server_args)
    return out


@contextlib.contextmanager
def server_for(args) -> Iterator[tuple[str, int | None]]:
    """(base url, pid of the server we started or None): --url as given, else a server of our own."""
    if args.url:
        yield args.url.rstrip("/"), None
        return
    with ServerProcess(serve_args_from(args), startup_timeout=args.startup_timeout) as srv:
        yield srv.url, srv.pid


def served_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url + "/v1/models", headers=headers, timeout=10.0)
    r.raise_for_status()
    return r.json()["data"][0]["id"]
