"""A long prompt must not hold short ones hostage (max_num_partial_prefills, long_prefill_token_threshold).

One 3000-token prompt arrives, then 8 short prompts one iteration later: on the real model in
strict SARATHI mode, and on a small synthetic model in token-budget mode (iteration counts do not
depend on the model; it keeps the test fast). Time to first token is counted in scheduler
iterations from the engine's step records, so the test is deterministic: with partial prefills
each short prompt's TTFT stays within a small multiple of its TTFT alone; with the one-chunk plan
it does not. Greedy fp32 outputs are the same either way.
"""
import pytest

from charioteer import LLM, SamplingParams
from charioteer.config import EngineArgs
from charioteer.model.loader import load_model
from texts import prompt_ids

LONG, SHORT, NUM_SHORT, CHUNK = 3000, 40, 8, 256
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
MULTIPLE = 4  # short prompts' TTFT behind the long one, in iterations, over their TTFT alone


def run_long_then_short(llm, long_prompt, shorts):
    """Outputs by request id, and each request's TTFT in iterations counted from its arrival."""
    engine = llm.engine
    first_step: dict[str, int] = {}

    def observe(record):
        for entry in record.entries:
            if entry.samples:
                first_step.setdefault(entry.request_id, record.index)

    unsubscribe = engine.subscribe(observe)
    arrived = {engine.add_request(long_prompt, PARAMS): 0}
    engine.step()
    arrived.update({engine.add_request(p, PARAMS): engine.num_steps for p in shorts})
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    unsubscribe()
    assert engine.blocks.num_used_blocks == 0
    return outputs, {rid: first_step[rid] - step + 1 for rid, step in arrived.items()}


def synthetic_ids(length: int, salt: int) -> list[int]:
    return [(salt * 131 + 7 * j) % 500 + 1 for j in range(length)]


@pytest.fixture(scope="module")
def long_context_tiny():
    return load_model("synthetic:tiny,context=4096")


@pytest.mark.parametrize("model, mode", [("default_model", dict()), ("long_context_tiny", dict(token_budget_mode=True))],
                         ids=["smollm2-strict", "tiny-token-budget"])
def test_short_prompts_are_not_held_hostage(request, model, mode):
    loaded = request.getfixturevalue(model)
    tok = loaded.tokenizer
    if tok is not None:
        long_prompt, shorts = prompt_ids(tok, LONG), [prompt_ids(tok, SHORT + i, offset=11 * i) for i in range(NUM_SHORT)]
    else:
        long_prompt, shorts = synthetic_ids(LONG, 0), [synthetic_ids(SHORT + i, i + 1) for i in range(NUM_SHORT)]
    alone_llm = LLM(loaded, chunk_size=CHUNK, **mode)
    alone = [_run_alone(alone_llm, p) for p in shorts]

    unfair_outs, unfair_ttft = run_long_then_short(LLM(loaded, chunk_size=CHUNK, **mode), long_prompt, shorts)
    fair_llm = LLM(loaded, chunk_size=CHUNK, max_num_partial_prefills=4, **mode)
    fair_outs, fair_ttft = run_long_then_short(fair_llm, long_prompt, shorts)

    ids = sorted(fair_ttft, key=int)
    long_id, short_ids = ids[0], ids[1:]
    for rid, (alone_out, alone_ttft) in zip(short_ids, alone):
        assert fair_ttft[rid] <= MULTIPLE * alone_ttft, (rid, fair_ttft[rid], alone_ttft)
        assert fair_outs[rid].outputs[0].token_ids == alone_out
    assert max(unfair_ttft[rid] for rid in short_ids) > MULTIPLE * max(a for _, a in alone), unfair_ttft
    # The long prompt still finishes, a little later than when it had every chunk to itself.
    assert fair_ttft[long_id] <= unfair_ttft[long_id] + NUM_SHORT
    for rid in ids:
        assert fair_outs[rid].outputs[0].token_ids == unfair_outs[rid].outputs[0].token_ids


def _run_alone(llm, prompt):
    engine = llm.engine
    steps = []
    unsubscribe = engine.subscribe(steps.append)
    out = llm.generate(prompt, PARAMS)[0]
    unsubscribe()
    first = next(i for i, record in enumerate(steps) if any(e.samples for e in record.entries))
    return out.outputs[0].token_ids, first + 1


def test_long_threshold_caps_a_long_prompt_and_lets_short_ones_pass(default_model):
    """Token-budget mode, one partial prefill: a long prompt takes at most the threshold per
    iteration, and a short prompt that fits the rest of the budget whole joins at once."""
    tok = default_model.tokenizer
    llm = LLM(default_model, chunk_size=128, token_budget_mode=True, long_prefill_token_threshold=64)
    steps = []
    llm.engine.subscribe(steps.append)
    outs = llm.generate([prompt_ids(tok, 300), prompt_ids(tok, 30, offset=5)], PARAMS)
    first = steps[0]
    assert sorted((e.request_id, e.num_tokens) for e in first.entries) == [("0", 64), ("1", 30)]
    assert all(e.num_tokens <= 64 for record in steps for e in record.entries)
    want = LLM(default_model, chunk_size=128).generate([prompt_ids(tok, 300), prompt_ids(tok, 30, offset=5)], PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheduler="orca", max_num_partial_prefills=2), "the orca scheduler runs whole prompts"),
    (dict(scheduler="vllm", long_prefill_token_threshold=64), "the vllm scheduler runs whole prompts"),
    (dict(max_num_partial_prefills=0), "max_num_partial_prefills must be >= 1"),
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3), "must be <= max_num_partial_prefills"),
    (dict(long_prefill_token_threshold=0), "long_prefill_token_threshold must be >= 1"),
])
def test_bad_partial_prefill_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_threshold_over_the_context_is_refused(default_model):
    with pytest.raises(ValueError, match="over the model's context of 512 tokens"):
        LLM(default_model, max_model_len=512, long_prefill_token_threshold=1000)
