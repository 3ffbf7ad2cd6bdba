"""Prefix caching with chunked prefill: shared prompt starts are prefilled once, outputs do not change."""
import pytest

from charioteer import LLM, SamplingParams
from charioteer.config import CacheConfig
from charioteer.memory.block_manager import BlockManager
from charioteer.request import Request
from texts import prompt_ids

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def shared_prefix_prompts(tokenizer, prefix_len=70, n=5):
    system = prompt_ids(tokenizer, prefix_len)
    return [system + prompt_ids(tokenizer, 9 + 4 * i, offset=100 + 11 * i) for i in range(n)]


def generate(model, prompts, params=GREEDY, **config):
    config.setdefault("num_kv_blocks", 96)
    llm = LLM(model, max_num_seqs=4, block_size=16, **config)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.blocks.num_used_blocks == 0  # nothing leaks; cached blocks are unused, not held
    return llm, outputs


@pytest.mark.parametrize("scheduler,chunk_size", [("sarathi", 32), ("vllm", 64)])
def test_outputs_match_without_caching(default_model, scheduler, chunk_size):
    prompts = shared_prefix_prompts(default_model.tokenizer)
    _, expected = generate(default_model, prompts, scheduler=scheduler, chunk_size=chunk_size)
    # The first prompt alone warms the cache; the rest then reuse its 4 full blocks of 16 tokens.
    llm, first = generate(default_model, prompts[:1], scheduler=scheduler, chunk_size=chunk_size,
                          enable_prefix_caching=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert first == expected[:1] and got == expected
    cache = llm.engine.blocks.prefix_cache
    assert cache.hits >= 64 * len(prompts)  # every prompt of the second call found the 70-token prefix's 4 blocks
    assert cache.hits < cache.queries


def test_prefilled_tokens_drop_by_the_hits(default_model):
    prompts = shared_prefix_prompts(default_model.tokenizer, prefix_len=100, n=4)
    llm = LLM(default_model, max_num_seqs=4, block_size=16, chunk_size=32, num_kv_blocks=96,
              enable_prefix_caching=True)
    llm.generate(prompts[:1], GREEDY)
    prefilled = []
    llm.engine.subscribe(lambda record: prefilled.append(record.num_prefill_tokens))
    hits = []
    llm.engine.subscribe(lambda record: hits.append(record.prefix_cache_hits))
    llm.generate(prompts, GREEDY)
    assert sum(hits) == 96 * len(prompts)  # 6 full blocks of the 100-token prefix each
    assert sum(prefilled) == sum(len(p) for p in prompts) - sum(hits)


def test_prompt_ending_inside_a_cached_block(default_model):
    tok = default_model.tokenizer
    long = prompt_ids(tok, 60)
    cut = long[:40]  # ends inside the cached prompt's third block: only blocks 0 and 1 are reused
    exact = long[:48]  # ends on a block boundary: its last token must still be computed, so 2 blocks
    _, expected = generate(default_model, [cut, exact])
    llm, _ = generate(default_model, [long], enable_prefix_caching=True)
    hits = []
    llm.engine.subscribe(lambda record: hits.append(record.prefix_cache_hits))
    got = [o.outputs[0].token_ids for o in llm.generate([cut, exact], GREEDY)]
    assert got == expected
    assert sum(hits) == 32 + 32


def test_preempted_while_holding_shared_blocks(default_model):
    prompts = shared_prefix_prompts(default_model.tokenizer, prefix_len=64, n=6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    _, expected = generate(default_model, prompts, params, chunk_size=32)
    # 14 blocks of 16 tokens: the requests outgrow them, so some are preempted while they share the prefix.
    llm, got = generate(default_model, prompts, params, chunk_size=32, num_kv_blocks=14,
                        enable_prefix_caching=True)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_pipeline_stages_share_cached_blocks(default_model):
    prompts = shared_prefix_prompts(default_model.tokenizer, n=3)
    _, expected = generate(default_model, prompts, chunk_size=32)
    llm = LLM(default_model, max_num_seqs=4, block_size=16, chunk_size=32, num_kv_blocks=96,
              enable_prefix_caching=True, pipeline_parallel_size=2)
    try:
        llm.generate(prompts[:1], GREEDY)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert got == expected
        assert llm.engine.blocks.prefix_cache.hits >= 64 * len(prompts)
        assert llm.engine.blocks.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_prompt_logprobs_requests_compute_their_whole_prompt(default_model):
    prompts = shared_prefix_prompts(default_model.tokenizer, n=2)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    plain = LLM(default_model, chunk_size=32, num_kv_blocks=96).generate(prompts, params)
    llm = LLM(default_model, chunk_size=32, num_kv_blocks=96, enable_prefix_caching=True)
    llm.generate(prompts[:1], GREEDY)
    cached = llm.generate(prompts, params)
    for a, b in zip(plain, cached):
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == len(a.prompt_token_ids)
        assert b.outputs[0].token_ids == a.outputs[0].token_ids


def _request(rid, tokens, max_tokens=4):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def _run_prefill(blocks, request):
    """What the scheduler does for a whole prompt: admit, make room, mark it computed, cache it."""
    request.num_computed_tokens = blocks.admit(request, request.num_tokens)
    assert blocks.ensure(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    blocks.cache_computed(request)


@pytest.mark.parametrize("contiguous", [False, True])
def test_unused_cached_blocks_are_evicted_least_recently_used_and_only_when_needed(contiguous):
    blocks = BlockManager(6, 4, prefer_contiguous=contiguous, enable_prefix_caching=True)
    a, b = _request("a", range(9)), _request("b", range(100, 109))  # 2 full blocks + 1 token each
    for r in (a, b):
        _run_prefill(blocks, r)
    blocks.free(a)
    blocks.free(b)  # a's blocks were released first: they are the least recently used
    assert blocks.num_used_blocks == 0 and blocks.num_free_blocks == 6
    again = _request("a2", range(9))
    assert blocks.admit(again, 1) == 8  # nothing was evicted: both of a's full blocks are found
    blocks.free(again)
    # 6 blocks wanted, 2 plain free: 4 cached ones are evicted, b's (released before a2's) first.
    big = _request("big", range(200, 224))
    assert blocks.admit(big, 24) == 0 and blocks.ensure(big, 24)
    assert blocks.prefix_cache.num_unused == 0 and blocks.num_free_blocks == 0
    blocks.free(big)
    assert blocks.admit(_request("b2", range(100, 109)), 1) == 0


def test_shared_blocks_stay_until_their_last_holder_lets_go():
    blocks = BlockManager(8, 4, enable_prefix_caching=True)
    a = _request("a", range(9))
    _run_prefill(blocks, a)
    b = _request("b", range(9))
    assert blocks.admit(b, 1) == 8
    assert blocks.block_table(b)[:2] == blocks.block_table(a)[:2]
    blocks.free(a)
    assert blocks.prefix_cache.num_unused == 0  # b still holds the shared blocks
    blocks.free(b)
    assert blocks.prefix_cache.num_unused == 2 and blocks.num_used_blocks == 0


def test_reserve_policy_refuses_prefix_caching():
    with pytest.raises(ValueError, match="kv_policy 'paged'"):
        CacheConfig(kv_policy="reserve", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="kv_policy 'paged'"):
        BlockManager(8, 4, policy="reserve", enable_prefix_caching=True)


def test_bench_prefix_caching_json(capsys):
    import json

    from charioteer.cli import main

    rc = main(["bench", "prefix-caching", "--model", "synthetic:tiny", "--json", "--prefix-len", "64",
               "--suffix-len", "8", "--num-requests", "3", "--max-tokens", "3", "--repeats", "2", "--chunk-size", "32"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["run"]: r for r in out["rows"]}
    assert rows["off"]["prefilled_tokens"] == 3 * (64 + 8)
    assert rows["on"]["prefilled_tokens"] == 64 + 3 * 8  # the shared 64 tokens are 4 full blocks, prefilled once
    assert out["outputs_identical"] is True
    assert out["ttft_speedup_verdict"] in {"faster", "slower", "not distinguishable"}
