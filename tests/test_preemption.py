"""A KV pool too small for the workload forces preemption by recompute; outputs do not change."""
import pytest

from charioteer import LLM, SamplingParams
from texts import prompt_ids


@pytest.mark.parametrize("scheduler", ["sarathi", "vllm"])
def test_preemption_keeps_outputs(default_model, scheduler):
    prompts = [prompt_ids(default_model.tokenizer, 40 + 13 * i, offset=7 * i) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    roomy = LLM(default_model, scheduler=scheduler, chunk_size=32, max_num_seqs=8)
    expected = roomy.generate(prompts, params)
    assert roomy.engine.scheduler.num_preemptions == 0

    # 16 blocks of 16 tokens: room for about two of these requests at full length.
    tight = LLM(default_model, scheduler=scheduler, chunk_size=32, max_num_seqs=8, num_kv_blocks=16, block_size=16)
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in got) == tight.engine.scheduler.num_preemptions
    assert tight.engine.blocks.num_used_blocks == 0
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            for token in a.keys() & b.keys():
                assert abs(a[token] - b[token]) < 1e-3


def test_reserve_policy_never_preempts(default_model):
    prompts = [prompt_ids(default_model.tokenizer, 40 + 13 * i, offset=7 * i) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(default_model, chunk_size=32, max_num_seqs=8, num_kv_blocks=16, block_size=16, kv_policy="reserve")
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions == 0
    assert all(len(o.outputs[0].token_ids) == 24 for o in outputs)
