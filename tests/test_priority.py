"""Priorities (scheduling_policy="priority"): lower first among waiting requests, the lowest running
one is preempted first under memory pressure, recomputed later, and nothing is lost."""
import httpx
import openai
import pytest

from charioteer import LLM, SamplingParams
from charioteer.serving.api import ServerConfig
from test_server import LiveServer
from texts import prompt_ids

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def first_token_steps(engine):
    """{request_id: index of the step that sampled its first token}, and the unsubscribe function."""
    first: dict[str, int] = {}

    def observe(record):
        for entry in record.entries:
            if entry.samples:
                first.setdefault(entry.request_id, record.index)

    return first, engine.subscribe(observe)


@pytest.mark.parametrize("scheduler", ["sarathi", "vllm"])
def test_high_priority_request_passes_a_full_cache(default_model, scheduler):
    tok = default_model.tokenizer
    low = [prompt_ids(tok, 90 + 7 * i, offset=13 * i) for i in range(5)]
    high = prompt_ids(tok, 100, offset=200)  # more blocks than the cache has left
    # 24 blocks of 16 tokens: room for about three of the low-priority requests.
    llm = LLM(default_model, scheduler=scheduler, scheduling_policy="priority", chunk_size=32,
              num_kv_blocks=24, block_size=16)
    engine = llm.engine
    first, unsubscribe = first_token_steps(engine)
    low_ids = [engine.add_request(p, PARAMS, priority=1) for p in low]
    while engine.blocks.num_free_blocks > 4:  # the low-priority requests fill the cache
        engine.step()
    waiting_for_first = [rid for rid in low_ids if rid not in first]
    assert waiting_for_first, "some low-priority requests must still wait for their first token"
    high_id = engine.add_request(high, PARAMS, priority=0)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    unsubscribe()

    assert all(first[high_id] < first[rid] for rid in waiting_for_first), (first, waiting_for_first)
    assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_used_blocks == 0
    alone = LLM(default_model, scheduler=scheduler, chunk_size=32)
    for rid, prompt in [*zip(low_ids, low), (high_id, high)]:
        want = alone.generate(prompt, PARAMS)[0].outputs[0].token_ids
        assert outputs[rid].outputs[0].token_ids == want, rid


def test_waiting_requests_are_admitted_by_priority_then_arrival(default_model):
    tok = default_model.tokenizer
    llm = LLM(default_model, scheduling_policy="priority", max_num_seqs=1, chunk_size=64)
    first, unsubscribe = first_token_steps(llm.engine)
    priorities = [2, 0, 1, 0, 2]
    outs = llm.generate([prompt_ids(tok, 20, offset=3 * i) for i in range(5)],
                        SamplingParams(temperature=0, max_tokens=2), priority=priorities)
    unsubscribe()
    order = sorted(range(5), key=lambda i: first[outs[i].request_id])
    assert order == [1, 3, 2, 0, 4]


def test_priority_needs_the_priority_policy(default_model):
    llm = LLM(default_model, max_model_len=256)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        llm.generate(["a", "b"], priority=[0, 1])
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(priority=1.5)
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate(["a", "b"], priority=[0])


def test_http_priority_field(default_model):
    server = LiveServer(default_model, ServerConfig(), scheduling_policy="priority", max_num_seqs=4)
    try:
        url = server.url + "/v1/completions"
        for bad in ("1", 1.5, True, [1]):
            r = httpx.post(url, json={"model": server.model, "prompt": "Hi", "max_tokens": 2, "priority": bad})
            assert r.status_code == 400, (bad, r.text)
            err = r.json()["error"]
            assert err["param"] == "priority" and err["type"] == "invalid_request_error"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=6,
                                        temperature=0, extra_body={"priority": -3})
        want = LLM(default_model).generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6))
        assert got.choices[0].text == want[0].text
        assert server.wait_idle()["charioteer:kv_cache_usage_perc"] == 0
    finally:
        server.stop()


def test_http_priority_refused_under_fcfs(default_model):
    server = LiveServer(default_model, ServerConfig(), max_num_seqs=4)
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json={
            "model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 1})
        assert r.status_code == 400
        assert "--scheduling-policy priority" in r.json()["error"]["message"]
        assert server.healthy()
    finally:
        server.stop()
