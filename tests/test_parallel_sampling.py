"""n > 1 and best_of: the prompt is prefilled once and its KV blocks are shared by the samples."""
import pytest

from charioteer import LLM, SamplingParams
from texts import prompt_ids

BLOCK = 16


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(default_model, chunk_size=64, max_num_seqs=8, num_kv_blocks=256, block_size=BLOCK)


def record_steps(llm):
    steps = []
    return steps, llm.engine.subscribe(steps.append)


def test_seeded_samples_equal_single_requests_with_their_seeds(llm, default_model):
    prompt = prompt_ids(default_model.tokenizer, 150)
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True, n=4)
    steps, stop = record_steps(llm)
    out = llm.generate(prompt, params)[0]
    stop()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert llm.engine.blocks.num_used_blocks == 0
    # The prompt is prefilled once: samples 1..3 compute only the tokens past the last full block.
    tail = len(prompt) - (len(prompt) - 1) // BLOCK * BLOCK
    assert sum(s.num_prefill_tokens for s in steps) == len(prompt) + 3 * tail
    for i, completion in enumerate(out.outputs):
        alone = llm.generate(prompt, SamplingParams(temperature=0.8, seed=11 + i, max_tokens=10, ignore_eos=True))
        assert completion.token_ids == alone[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_memory_for_eight_samples_is_far_below_eight_copies(llm, default_model):
    prompt = prompt_ids(default_model.tokenizer, 600)
    peaks = {}
    for n in (1, 8):
        steps, stop = record_steps(llm)
        llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, n=n))
        stop()
        peaks[n] = max(s.kv_blocks_used for s in steps)
    # One copy of a 600-token prompt is 38 blocks; eight share those and add 1-2 blocks each.
    assert peaks[8] < 1.5 * peaks[1], peaks
    assert llm.engine.blocks.num_used_blocks == 0


def test_best_of_returns_the_n_most_likely_samples(llm, default_model):
    prompt = prompt_ids(default_model.tokenizer, 40)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, n=2, best_of=5)
    out = llm.generate(prompt, params)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in out.outputs)  # not asked for
    scored = llm.generate(prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, n=5,
                                                 logprobs=0))[0]
    ranked = sorted(scored.outputs, key=lambda c: -c.cumulative_logprob)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]


def test_preemption_and_reserved_kv_keep_the_samples(default_model):
    tok = default_model.tokenizer
    prompts = [prompt_ids(tok, 70), prompt_ids(tok, 50, offset=30)]
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=20, ignore_eos=True, n=3)
    roomy = LLM(default_model, chunk_size=32, max_num_seqs=8, num_kv_blocks=128)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params)]
    tight = LLM(default_model, chunk_size=32, max_num_seqs=8, num_kv_blocks=13)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected and tight.engine.blocks.num_used_blocks == 0
    reserve = LLM(default_model, chunk_size=32, max_num_seqs=8, num_kv_blocks=128, kv_policy="reserve")
    assert [[c.token_ids for c in o.outputs] for o in reserve.generate(prompts, params)] == expected
    assert reserve.engine.blocks.num_used_blocks == 0


def test_samples_with_prefix_caching_and_pipeline_stages(tiny_model):
    prompt = list(range(3, 60))
    params = SamplingParams(temperature=0.9, seed=2, max_tokens=6, ignore_eos=True, n=3, logprobs=1)
    expected = LLM(tiny_model, chunk_size=16, num_kv_blocks=64).generate(prompt, params)[0]
    with LLM(tiny_model, chunk_size=16, num_kv_blocks=64, pipeline_parallel_size=2,
             enable_prefix_caching=True) as piped:
        got = piped.generate(prompt, params)[0]
        assert piped.engine.blocks.num_used_blocks == 0
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]


def test_aborting_a_waiting_sample_or_its_sample_zero(llm, default_model):
    engine = llm.engine
    leader = engine.make_request(prompt_ids(default_model.tokenizer, 200), SamplingParams(max_tokens=4, n=3))
    samples = engine.make_samples(leader)
    for s in samples:
        engine.add(s)
    engine.abort(samples[1].request_id)  # still waiting for sample 0's prompt
    engine.abort(leader.request_id)  # sample 2 then prefills on its own
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == [samples[2].request_id]
    assert len(outputs[0].outputs[0].token_ids) == 4 and engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("kwargs,match", [({"n": 0}, "n must be"), ({"n": 3, "best_of": 2}, "best_of must be"),
                                          ({"n": True}, "n must be")])
def test_bad_sample_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
