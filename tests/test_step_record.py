"""The per-iteration step record: every observer sees exactly what each step ran."""
import json

import pytest

from charioteer import LLM, SamplingParams


def _run(llm, prompts, params):
    steps = []
    unsubscribe = llm.engine.subscribe(steps.append)
    outputs = llm.generate(prompts, params)
    unsubscribe()
    return steps, outputs


@pytest.mark.parametrize("scheduler", ["sarathi", "orca", "vllm", "request-level"])
def test_records_account_for_every_token(tiny_model, scheduler):
    prompts = [[(7 * i + j) % 200 + 1 for j in range(20 + 9 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(tiny_model, scheduler=scheduler, chunk_size=16, max_num_seqs=4)
    steps, outputs = _run(llm, prompts, params)

    assert [s.index for s in steps] == list(range(len(steps)))
    assert len(steps) == llm.engine.num_steps
    by_id = {o.request_id: o for o in outputs}
    for rid, out in by_id.items():
        mine = [e for s in steps for e in s.entries if e.request_id == rid]
        # Prompt positions are covered once, in order, by prefill entries; each output token but the
        # last is fed back once as a decode.
        prefill = [e for e in mine if e.is_prefill]
        assert [e.start for e in prefill] == [0] + [sum(e.num_tokens for e in prefill[:i]) for i in range(1, len(prefill))]
        assert sum(e.num_tokens for e in prefill) == len(out.prompt_token_ids)
        assert sum(1 for e in mine if not e.is_prefill) == len(out.outputs[0].token_ids) - 1
        assert sum(e.samples for e in mine) == len(out.outputs[0].token_ids)
        assert sum(rid in s.finished for s in steps) == 1
    for s in steps:
        assert s.num_tokens == s.num_prefill_tokens + s.num_decode_tokens
        assert len({e.request_id for e in s.entries}) == len(s.entries)
        assert 0 <= s.kv_blocks_used <= s.kv_blocks_total
        assert s.duration_s >= s.schedule_s >= 0 and s.execute_s >= 0
        assert s.pipeline is None
        if scheduler == "sarathi":
            assert sum(e.is_prefill for e in s.entries) <= 1  # one prompt chunk per batch
            assert s.token_budget == 16
    assert steps[-1].kv_blocks_used == 0 and steps[-1].num_running == 0
    json.dumps(steps[0].to_dict())  # what a live view would stream


def test_records_show_preemptions(default_model):
    from texts import prompt_ids

    prompts = [prompt_ids(default_model.tokenizer, 40 + 13 * i, offset=7 * i) for i in range(6)]
    llm = LLM(default_model, chunk_size=32, max_num_seqs=6, num_kv_blocks=12, block_size=16)
    steps, _ = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert sum(len(s.preempted) for s in steps) == llm.engine.scheduler.num_preemptions > 0
    assert max(s.kv_blocks_used for s in steps) <= 12


def test_unsubscribed_observer_hears_nothing(tiny_model):
    llm = LLM(tiny_model, chunk_size=16)
    heard = []
    llm.engine.subscribe(heard.append)()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert heard == []


def test_stop_string_finishes_in_the_record(default_model):
    llm = LLM(default_model, chunk_size=32)
    steps, outputs = _run(llm, ["The capital of France is"],
                          SamplingParams(temperature=0, max_tokens=24, stop=[" "]))
    out = outputs[0].outputs[0]
    assert out.finish_reason == "stop" and " " not in out.text
    assert steps[-1].finished == (outputs[0].request_id,)


def test_a_dropped_engine_is_freed_without_the_garbage_collector(tiny_model):
    """No reference cycle keeps an engine (its weights and KV cache) alive after its last user."""
    import gc
    import weakref

    from charioteer import LLM, SamplingParams

    gc.disable()
    try:
        llm = LLM(tiny_model, max_num_seqs=2)
        unsubscribe = llm.engine.subscribe(lambda record: None)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stop=["x"]))
        unsubscribe()
        engine = weakref.ref(llm.engine)
        del llm, unsubscribe
        assert engine() is None
    finally:
        gc.enable()
