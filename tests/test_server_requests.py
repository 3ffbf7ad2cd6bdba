"""The request shapes clients send beyond the basics: batched prompts, echo, usage in every chunk,
and vLLM's /tokenize and /detokenize. Through the official `openai` client (httpx where it has no
call) against a real server, checked against the offline engine's greedy outputs."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from live_server import LiveServer

from charioteer import LLM, SamplingParams
from charioteer.serving.api import ServerConfig

API_KEY = "tok-key"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return",
    "Water boils at one hundred degrees Celsius at sea level, but",
]


@pytest.fixture(scope="module")
def server(default_model):
    # max_num_seqs 2 + max_queue 3: at most 5 requests outstanding, so batches of 3 wait their turn.
    s = LiveServer(default_model, ServerConfig(max_queue=3), scheduler="sarathi", chunk_size=32, max_num_seqs=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(default_model):
    return LLM(default_model, max_num_seqs=8)


@pytest.fixture(scope="module")
def want(offline):
    """Greedy outputs of PROMPTS, 6 tokens each."""
    return offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6))


def _create(client, server, **kw):
    return client.completions.create(**{"model": server.model, "temperature": 0, "max_tokens": 6, **kw})


# ---- batched prompts ------------------------------------------------------------------------


def test_batch_of_strings_and_of_token_lists(server, client, offline, want):
    for prompt in (PROMPTS, [list(w.prompt_token_ids) for w in want]):
        got = _create(client, server, prompt=prompt)
        assert [c.index for c in got.choices] == [0, 1, 2]
        assert [c.text for c in got.choices] == [w.text for w in want]
        assert [c.finish_reason for c in got.choices] == [w.outputs[0].finish_reason for w in want]
        assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
        assert got.usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in want)
    one = _create(client, server, prompt=list(want[1].prompt_token_ids))  # a single token list is one prompt
    assert len(one.choices) == 1 and one.choices[0].text == want[1].text
    assert server.wait_idle()["charioteer:kv_cache_usage_perc"] == 0


def test_batch_streams_each_choice_by_index(server, client, want):
    chunks = list(_create(client, server, prompt=PROMPTS, stream=True, stream_options={"include_usage": True}))
    texts, finishes = ["", "", ""], [[], [], []]
    for c in chunks[:-1]:
        assert c.id == chunks[0].id and len(c.choices) == 1 and c.usage is None
        texts[c.choices[0].index] += c.choices[0].text
        if c.choices[0].finish_reason:
            finishes[c.choices[0].index].append(c.choices[0].finish_reason)
    assert texts == [w.text for w in want]
    assert finishes == [[w.outputs[0].finish_reason] for w in want]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in want)
    assert last.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)


def test_a_bad_prompt_fails_the_batch_and_frees_the_rest(server):
    too_long = list(range(100, 100 + server.engine.max_model_len))
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [[1, 2, 3], too_long, [4, 5]], "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith("prompt 1: ") and "context" in err["message"], err
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["Hi"] * 6, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "send fewer" in r.json()["error"]["message"]  # more than 5 can ever be held
    m = server.wait_idle()
    assert m["charioteer:kv_cache_usage_perc"] == 0 and m["charioteer:num_requests_running"] == 0
    assert server.healthy()


def test_leaving_a_batched_stream_aborts_every_prompt(server):
    before = server.metrics()["charioteer:num_requests_aborted_total"]
    body = {"prompt": ["Count: 1, 2, 3,"] * 3, "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def leave_early():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        return

    asyncio.run(asyncio.wait_for(leave_early(), 60))
    m = server.wait_idle(timeout=20)
    assert m["charioteer:kv_cache_usage_perc"] == 0 and m["charioteer:num_requests_waiting"] == 0
    assert m["charioteer:num_requests_aborted_total"] - before == 3


# ---- echo -----------------------------------------------------------------------------------


def test_echo_returns_the_prompt_and_its_logprobs(server, client, want):
    got = _create(client, server, prompt=PROMPTS[:2], echo=True, logprobs=1)
    for choice, w, prompt in zip(got.choices, want, PROMPTS):
        assert choice.text == prompt + w.text
        lp = choice.logprobs
        n_prompt, n_out = len(w.prompt_token_ids), len(w.outputs[0].token_ids)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + n_out
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
        assert all(v <= 0 for v in lp.token_logprobs[1:])
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    only = _create(client, server, prompt=PROMPTS[0], echo=True, max_tokens=0, logprobs=0)
    assert only.choices[0].text == PROMPTS[0]
    assert len(only.choices[0].logprobs.tokens) == len(want[0].prompt_token_ids)

    ids = list(want[1].prompt_token_ids)  # a token-id prompt echoes as its text
    by_ids = _create(client, server, prompt=ids, echo=True)
    decoded = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert decoded == PROMPTS[1] and by_ids.choices[0].text == decoded + want[1].text


def test_echo_streams_the_prompt_with_the_first_token(server, client, want):
    chunks = list(_create(client, server, prompt=PROMPTS[0], echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPTS[0]) and len(chunks[0].choices[0].text) > len(PROMPTS[0])
    assert "".join(c.choices[0].text for c in chunks) == PROMPTS[0] + want[0].text


# ---- usage in the stream --------------------------------------------------------------------


def test_continuous_usage_stats(server, client, want):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(_create(client, server, prompt=PROMPTS, stream=True, stream_options=options))
    seen = {}
    for c in chunks[:-1]:
        i = c.choices[0].index
        assert c.usage.prompt_tokens == len(want[i].prompt_token_ids)
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        assert c.usage.completion_tokens > seen.get(i, 0)  # every chunk here carries a new token
        seen[i] = c.usage.completion_tokens
    assert seen == {i: len(w.outputs[0].token_ids) for i, w in enumerate(want)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(seen.values())

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=5, temperature=0,
                                               stream=True, stream_options=options))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    counts = [c.usage.completion_tokens for c in chat[:-1]]
    assert counts == sorted(counts) and chat[-1].usage.completion_tokens == counts[-1] >= 1
    assert len({c.usage.prompt_tokens for c in chat}) == 1


def test_stream_options_default_to_usage_as_vllm(server):
    body = {"prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": {}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


# ---- /tokenize and /detokenize --------------------------------------------------------------


def test_tokenize_and_detokenize(server, offline):
    tok = offline.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"model": server.model, "prompt": PROMPTS[1],
                                                  "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(PROMPTS[1]) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.engine.max_model_len
    assert body["token_strs"] == [tok.token_to_str(t) for t in body["tokens"]]
    plain = httpx.post(server.url + "/tokenize", json={"prompt": "Hi"}, timeout=30).json()
    assert plain["token_strs"] is None and plain["count"] == len(tok.encode("Hi"))
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()
    assert back == {"prompt": PROMPTS[1]}

    messages = [{"role": "user", "content": "Say hello."}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    assert chat["tokens"] == offline.apply_chat_template(messages)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    done = client.chat.completions.create(model=server.model, messages=messages, max_tokens=1)
    assert done.usage.prompt_tokens == chat["count"]
    bare = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False},
                      timeout=30).json()
    assert bare["count"] < chat["count"] and chat["tokens"][: bare["count"]] == bare["tokens"]


TOKENIZE_BAD = [
    ("/tokenize", {"prompt": "Hi", "add_special_token": True}, 400, "add_special_token"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "Hi", "model": "gpt-17"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True,
                   "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ 1 }}"}, 400,
     "chat_template"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", TOKENIZE_BAD, ids=[str(b[1]) for b in TOKENIZE_BAD])
def test_tokenize_bad_input(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param


def test_tokenize_needs_the_api_key(default_model):
    s = LiveServer(default_model, ServerConfig(api_key=API_KEY), max_num_seqs=1)
    try:
        for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(s.url + path, json=body, timeout=30).status_code == 401
            ok = httpx.post(s.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
            assert ok.status_code == 200, ok.text
    finally:
        s.stop()


# ---- n and best_of --------------------------------------------------------------------------


def _sampled(offline, prompt, seed, n, **kw):
    params = SamplingParams(temperature=0.9, seed=seed, max_tokens=6, n=n, **kw)
    return offline.generate(prompt, params)[0].outputs


def test_n_samples_in_both_endpoints_match_the_offline_engine(server, client, offline):
    got = _create(client, server, prompt=PROMPTS[0], n=3, temperature=0.9, seed=21)
    want = _sampled(offline, PROMPTS[0], 21, 3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert got.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPTS[0]))  # the prompt counts once
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)

    messages = [{"role": "user", "content": "Name a colour."}]
    chat_want = offline.generate(offline.apply_chat_template(messages),
                                 SamplingParams(temperature=0.9, seed=4, max_tokens=6, n=2))[0].outputs
    chunks = client.chat.completions.create(model=server.model, messages=messages, n=2, temperature=0.9, seed=4,
                                            max_tokens=6, stream=True)
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [w.text for w in chat_want]
    assert server.wait_idle()["charioteer:kv_cache_usage_perc"] == 0


def test_batched_prompts_with_n_are_indexed_prompt_major(server, client, offline):
    got = _create(client, server, prompt=PROMPTS[:2], n=2, temperature=0.9, seed=8)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    want = [w.text for p in PROMPTS[:2] for w in _sampled(offline, p, 8, 2)]
    assert [c.text for c in got.choices] == want


def test_echo_with_n_gives_every_sample_the_prompt_logprobs(server, client, offline):
    got = _create(client, server, prompt=PROMPTS[0], n=2, temperature=0.9, seed=3, echo=True, logprobs=1)
    n_prompt = len(offline.tokenizer.encode(PROMPTS[0]))
    prompt_parts = [c.logprobs.token_logprobs[:n_prompt] for c in got.choices]
    assert prompt_parts[0][0] is None and all(v is not None and v <= 0 for v in prompt_parts[0][1:])
    assert prompt_parts[1] == prompt_parts[0]  # sample 1 shows the prompt's logprobs that sample 0 computed
    assert got.choices[1].logprobs.top_logprobs[1] == got.choices[0].logprobs.top_logprobs[1]
    assert all(c.text.startswith(PROMPTS[0]) for c in got.choices)


def test_best_of_keeps_the_most_likely_sample(server, client, offline):
    got = _create(client, server, prompt=PROMPTS[2], best_of=3, temperature=0.9, seed=5)
    ranked = sorted(_sampled(offline, PROMPTS[2], 5, 3, logprobs=0), key=lambda c: -c.cumulative_logprob)
    assert [c.text for c in got.choices] == [ranked[0].text]
    assert got.choices[0].logprobs is None


@pytest.mark.parametrize("body,param", [({"n": 0}, "n"), ({"n": 2, "best_of": 1}, "best_of"),
                                        ({"best_of": 2, "stream": True}, "best_of"), ({"n": 65}, "n")])
def test_bad_sample_counts_get_a_400(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_vllm_bench_serve_body_is_taken(server):
    """The body `vllm bench serve --backend openai` (vLLM 0.32) sends: neutral vLLM sampling extensions."""
    body = {"model": server.model, "prompt": PROMPTS[0], "repetition_penalty": 1.0, "max_tokens": 3,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0.0, "min_p": 0.0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 3
