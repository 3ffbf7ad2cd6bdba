"""The OpenAI-compatible server, on a real uvicorn server on loopback, with the default model."""
from __future__ import annotations

import asyncio
import gc
import json
import random
import re
import threading
import time
import weakref

import httpx
import openai
import pytest
from live_server import LiveServer

from charioteer import LLM, SamplingParams
from charioteer.serving.api import ServerConfig

API_KEY = "sekret-key"


@pytest.fixture(scope="module")
def server(default_model):
    # Sarathi-Serve's token-budget mode admits many prompts per step, and 40 blocks of 16 tokens
    # cannot hold 32 running requests at full length: the load test preempts by recompute.
    s = LiveServer(default_model, ServerConfig(max_queue=256, max_body_bytes=128 * 1024),
                   scheduler="sarathi", chunk_size=256, token_budget_mode=True, max_num_seqs=32,
                   num_kv_blocks=40, block_size=16)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small_server(default_model):
    s = LiveServer(default_model, ServerConfig(api_key=API_KEY, max_queue=1),
                   scheduler="sarathi", chunk_size=64, max_num_seqs=1, num_kv_blocks=64, block_size=16)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(default_model):
    return LLM(default_model, max_num_seqs=32)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(offline, prompt, max_tokens):
    return offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0]


# ---- the official client --------------------------------------------------------------------


def test_openai_client_completes(server, client, offline):
    prompt = "The capital of France is"
    got = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0)
    want = greedy(offline, prompt, 8)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_openai_client_chats(server, client, offline):
    messages = [{"role": "user", "content": "Say hello in one word."}]
    got = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12, temperature=0)
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0]
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason in ("stop", "length")
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_openai_client_streams(server, client, offline):
    prompt = "Once upon a time"
    chunks = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    want = greedy(offline, prompt, 10)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.outputs[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)
    assert len([c for c in chunks if c.choices]) >= 2  # really streamed

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=10,
                                               temperature=0, stream=True))
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0]
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat) == want.text
    assert chat[-1].choices[0].finish_reason in ("stop", "length")


def test_logprobs_stop_and_seed(server, client):
    got = client.completions.create(model=server.model, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0,
                                    logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == got.usage.completion_tokens == len(lp.token_logprobs)
    assert "".join(lp.tokens) == got.choices[0].text
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens

    stopped = client.completions.create(model=server.model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                        stop=[","])
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"

    a, b = (client.completions.create(model=server.model, prompt="Tell me a story", max_tokens=8,
                                      temperature=1.0, seed=7).choices[0].text for _ in range(2))
    assert a == b


def test_models_health_metrics(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == server.model
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "iteration_tokens_total_bucket",
                 "iteration_prefill_tokens_bucket", "iteration_decode_tokens_bucket",
                 "iteration_duration_seconds_bucket"):
        assert f"charioteer:{name}" in text, name


def _iteration_series(server) -> dict[tuple[str, str], float]:
    """(series name, kind label or '') -> value, for the per-iteration histograms' counts and sums."""
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'^charioteer:(iteration_\w+_(?:count|sum))\{([^}]*)\} (\S+)$', line)
        if m:
            kind = re.search(r'kind="(\w+)"', m.group(2))
            out[(m.group(1), kind.group(1) if kind else "")] = float(m.group(3))
    return out


def test_iteration_histograms_add_up_to_the_records(server, client):
    server.wait_idle()
    records = []
    unsubscribe = server.engine.subscribe(records.append)
    before = _iteration_series(server)
    threads = [threading.Thread(target=client.completions.create, kwargs=dict(
        model=server.model, prompt=f"Story {i}: " + "once upon a time " * (4 + 9 * i), max_tokens=6,
        temperature=0)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.wait_idle()
    deadline = time.monotonic() + 10  # the last record reaches our observer just after the metrics
    while True:
        after = _iteration_series(server)
        grown = after[("iteration_prefill_tokens_count", "")] - before[("iteration_prefill_tokens_count", "")]
        if grown == len(records) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    unsubscribe()
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    n = len(records)
    assert n > 0 and delta[("iteration_tokens_total_count", "")] == n
    assert delta[("iteration_prefill_tokens_count", "")] == delta[("iteration_decode_tokens_count", "")] == n
    assert delta[("iteration_prefill_tokens_sum", "")] == sum(r.num_prefill_tokens for r in records)
    assert delta[("iteration_decode_tokens_sum", "")] == sum(r.num_decode_tokens for r in records)
    for kind in ("prefill", "decode", "mixed"):
        mine = [r for r in records if r.kind == kind]
        assert delta[("iteration_duration_seconds_count", kind)] == len(mine), kind
        assert delta[("iteration_duration_seconds_sum", kind)] == pytest.approx(sum(r.duration_s for r in mine))
    assert sum(r.kind == "decode" for r in records) and sum(r.kind != "decode" for r in records)


# ---- bad input ------------------------------------------------------------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
OK = {"model": None, "prompt": "Hello", "max_tokens": 2}
MSG = [{"role": "user", "content": "Hi"}]

BAD = [
    # (name, path, body: dict or raw bytes, status, param)
    ("malformed json", C, b'{"prompt": "Hello",', 400, None),
    ("not an object", C, b'["Hello"]', 400, None),
    ("empty body", C, b"", 400, None),
    ("nan", C, b'{"prompt": "Hi", "temperature": NaN}', 400, None),
    ("max_tokens string", C, {"prompt": "Hi", "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens float", C, {"prompt": "Hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ("prompt wrong type", C, {"prompt": 5}, 400, "prompt"),
    ("stream not bool", C, {"prompt": "Hi", "stream": "yes"}, 400, "stream"),
    ("messages wrong type", CH, {"messages": "Hi"}, 400, "messages"),
    ("bad role", CH, {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages.0.role"),
    ("unknown field", C, {"prompt": "Hi", "max_token": 5}, 400, "max_token"),
    ("missing prompt", C, {"max_tokens": 5}, 400, "prompt"),
    ("n=0", C, {"prompt": "Hi", "n": 0}, 400, "n"),
    ("suffix", C, {"prompt": "Hi", "suffix": "!"}, 400, "suffix"),
    ("repetition penalty", C, {"prompt": "Hi", "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ("min_p", CH, {"messages": MSG, "min_p": 0.1}, 400, "min_p"),
    ("tools", CH, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    ("max_tokens 0", C, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative chat", CH, {"messages": MSG, "max_tokens": -3}, 400, "max_tokens"),
    ("temperature negative", C, {"prompt": "Hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p zero", C, {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ("top_p over one", CH, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("empty prompt", C, {"prompt": ""}, 400, "prompt"),
    ("empty token list", C, {"prompt": []}, 400, "prompt"),
    ("token id out of vocab", C, {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("empty messages", CH, {"messages": []}, 400, "messages"),
    ("empty message text", CH, {"messages": [{"role": "user", "content": ""}]}, 400, "messages"),
    ("empty prompt in a batch", C, {"prompt": ["a", ""]}, 400, "prompt"),
    ("empty token list in a batch", C, {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("strings and token lists mixed", C, {"prompt": ["a", [1, 2]]}, 400, "prompt"),
    ("bad token in a batch", C, {"prompt": [[1, 2], [3, 10**9]]}, 400, "prompt"),
    ("negative seed", C, {"prompt": "Hi", "seed": -1}, 400, "seed"),
    ("too many logprobs", C, {"prompt": "Hi", "logprobs": 1000}, 400, "logprobs"),
    ("empty stop", C, {"prompt": "Hi", "stop": [""]}, 400, "stop"),
    ("stream_options without stream", C, {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("continuous usage without usage", C, {"prompt": "Hi", "stream": True, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}}, 400, "stream_options.continuous_usage_stats"),
    ("stream_options unknown field", CH, {"messages": MSG, "stream": True, "stream_options": {"usage": True}}, 400,
     "stream_options.usage"),
    ("unknown model", C, {"prompt": "Hi", "model": "gpt-17"}, 404, "model"),
    ("unknown model chat", CH, {"messages": MSG, "model": "gpt-17"}, 404, "model"),
    ("invalid utf-8", C, b'{"prompt": "caf\xc3\x28"}', 400, None),
    ("lone surrogate", C, b'{"prompt": "x\\ud800y"}', 400, None),
    ("body over limit", C, {"prompt": "x" * 200_000}, 413, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_4xx(server, name, path, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert server.healthy()


def test_over_context_names_both_numbers(server):
    n = server.engine.max_model_len
    for path, body in ((C, {"prompt": "Hello there", "max_tokens": n}),
                       (CH, {"messages": MSG, "max_tokens": n})):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert str(n) in message and "prompt has" in message, message
    # Also without max_tokens: a chat may use the rest of the context, a prompt longer than it may not.
    long_prompt = list(range(100, 100 + n))
    r = httpx.post(server.url + C, json={"prompt": long_prompt, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and str(n) in r.json()["error"]["message"]
    r = httpx.post(server.url + "/nope", json={})
    assert r.status_code == 404 and "error" in r.json()
    assert server.healthy()


# ---- auth, overload, disconnect -------------------------------------------------------------


def test_api_key(small_server):
    url = small_server.url
    body = {"prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(url + C, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # probes need no key
    r = httpx.post(url + C, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    c = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert c.completions.create(model=small_server.model, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_queue_full_and_disconnect_free_kv(small_server):
    """max_num_seqs=1 and max_queue=1: two long requests fill it; the third gets 503 + Retry-After.

    Closing the two streams aborts both requests: KV usage drops to zero without them finishing.
    """
    headers = {"Authorization": f"Bearer {API_KEY}"}
    long = {"prompt": "Count: 1, 2, 3,", "max_tokens": 500, "ignore_eos": True, "stream": True}
    before = small_server.metrics()["charioteer:generation_tokens_total"]

    async def scenario():
        async with httpx.AsyncClient(base_url=small_server.url, headers=headers, timeout=30) as http:
            async with http.stream("POST", C, json=long) as first:
                assert first.status_code == 200
                lines = first.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass
                async with http.stream("POST", C, json=long) as second:
                    assert second.status_code == 200  # accepted, waiting
                    t0 = time.monotonic()
                    third = await http.post(C, json={"prompt": "Hi", "max_tokens": 2})
                    assert time.monotonic() - t0 < 5  # refused at once, never hangs
                    assert third.status_code == 503, third.text
                    assert int(third.headers["retry-after"]) >= 1
                    assert third.json()["error"]["code"] == "queue_full"
                    assert small_server.metrics()["charioteer:kv_cache_usage_perc"] > 0
        # Both streams are closed (disconnected) here.

    asyncio.run(asyncio.wait_for(scenario(), 60))
    t0 = time.monotonic()
    m = small_server.wait_idle(timeout=10)
    assert m["charioteer:kv_cache_usage_perc"] == 0 and m["charioteer:num_requests_running"] == 0
    assert time.monotonic() - t0 < 5
    assert m["charioteer:generation_tokens_total"] - before < 2 * 500  # aborted, not run to the end
    assert m["charioteer:num_requests_aborted_total"] >= 2
    r = httpx.post(small_server.url + C, json={"prompt": "Hi", "max_tokens": 2}, headers=headers, timeout=30)
    assert r.status_code == 200


def test_non_streaming_disconnect_aborts(small_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(small_server.url + C, json={"prompt": "Count:", "max_tokens": 500, "ignore_eos": True},
                   headers=headers, timeout=httpx.Timeout(30, read=1.0))
    m = small_server.wait_idle(timeout=10)
    assert m["charioteer:kv_cache_usage_perc"] == 0 and m["charioteer:num_requests_running"] == 0


# ---- load -----------------------------------------------------------------------------------

# 10 to 16 tokens each: a request starts in one 16-token block and needs a second one while decoding.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then the fox",
    "In 1492, Columbus sailed across the ocean blue and found",
    "def fibonacci(n):\n    if n < 2:\n        return",
    "My favourite food is pizza with extra cheese, because",
    "The weather today is sunny and warm, so we decided to",
    "Water boils at one hundred degrees Celsius at sea level, but",
    "Once upon a time, a dragon lived in a cave near the village of",
    "The best way to learn a new language is to practise",
    "Paris is a city that millions of tourists visit every year to",
    "import numpy as np\nx = np.arange(10)\nprint(",
]


# Prefix caching needs full blocks to share: the all-features soak puts this before every prompt.
SYSTEM = ("You are a careful assistant. Answer briefly and plainly, in one sentence, and never repeat "
          "the question. Continue the text: ")


@pytest.fixture(scope="module")
def server_all_features(default_model):
    """The load test's server with the serving features on together: priorities, partial prefills,
    prefix caching and a TBT SLO driving the token budget."""
    s = LiveServer(default_model, ServerConfig(max_queue=256, max_body_bytes=128 * 1024),
                   scheduler="sarathi", chunk_size=256, token_budget_mode=True, max_num_seqs=32,
                   num_kv_blocks=24, block_size=16, scheduling_policy="priority", max_num_partial_prefills=4,
                   long_prefill_token_threshold=64, enable_prefix_caching=True, tbt_slo_ms=2000)
    yield s
    s.stop()


def test_load_200_streams_20_disconnect(server, offline):
    _load_200_streams(server, offline, "", priorities=False)


def test_load_with_every_serving_feature_on(server_all_features, offline):
    m = _load_200_streams(server_all_features, offline, SYSTEM, priorities=True)
    assert m["charioteer:prefix_cache_hits_total"] > 0


def _load_200_streams(server, offline, system: str, priorities: bool) -> dict[str, float]:
    n_clients, n_drop = 200, 20
    prompts = [system + p for p in PROMPTS]
    max_tokens = [8 + (i % 9) for i in range(len(PROMPTS))]
    want = [o.text for o in offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=m)
                                                      for m in max_tokens])]
    drop = set(random.Random(0).sample(range(n_clients), n_drop))
    before = server.metrics()

    async def one(http: httpx.AsyncClient, i: int):
        k = i % len(PROMPTS)
        body = {"model": server.model, "prompt": prompts[k], "max_tokens": max_tokens[k], "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        if priorities:
            body["priority"] = i % 3
        text, done, usage = [], False, None
        async with http.stream("POST", C, json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["text"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if i in drop:
                    return None  # leaves the stream: the connection closes mid-stream
        assert done
        return k, "".join(text), usage

    async def run():
        limits = httpx.Limits(max_connections=n_clients + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(n_clients)))

    t0 = time.monotonic()
    results = asyncio.run(asyncio.wait_for(run(), 150))
    elapsed = time.monotonic() - t0
    completed = [r for r in results if r is not None]
    assert len(completed) == n_clients - n_drop
    for k, text, usage in completed:
        assert text == want[k], (prompts[k], text, want[k])
        assert usage["completion_tokens"] <= max_tokens[k]
    m = server.wait_idle(timeout=10)
    assert m["charioteer:kv_cache_usage_perc"] == 0
    assert m["charioteer:num_requests_running"] == 0 and m["charioteer:num_requests_waiting"] == 0
    assert m["charioteer:num_preemptions_total"] > before.get("charioteer:num_preemptions_total", 0)
    assert m["charioteer:num_requests_aborted_total"] - before["charioteer:num_requests_aborted_total"] <= n_drop
    assert server.healthy()
    print(f"load: {n_clients} streams in {elapsed:.1f}s, "
          f"{m['charioteer:num_preemptions_total']:.0f} preemptions")
    return m


def test_a_stopped_server_lets_go_of_its_engine(default_model):
    # FastAPI keeps the endpoints it has seen in a module-level cache; were they the Server's bound methods, every
    # app built in a process would keep its engine (weights, KV cache) for good
    s = LiveServer(default_model, ServerConfig(), max_num_seqs=1, num_kv_blocks=16, block_size=16)
    httpx.post(s.url + "/v1/completions", json={"model": s.model, "prompt": "Hi", "max_tokens": 2},
               timeout=60).raise_for_status()
    engine = weakref.ref(s.engine)
    s.stop()
    del s
    gc.collect()
    assert engine() is None, "something still holds the engine of a stopped and dropped server"
