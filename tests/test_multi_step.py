"""Multi-step decoding (num_scheduler_steps): a decode-only plan's steps run in one loop and the engine
replays them, so tokens, text, stop reasons and step records are those of one step per plan."""
import pytest

from charioteer import SamplingParams
from charioteer.config import EngineArgs
from charioteer.engine.llm_engine import LLMEngine
from charioteer.engine.tbt import TimeBetweenTokens

from texts import PASSAGE

PROMPTS = [PASSAGE[:150], PASSAGE[200:420], PASSAGE[500:560], PASSAGE[600:900]]


def _params(tokenizer) -> list[SamplingParams]:
    """Greedy to a stop token (" future", about 20 tokens in), a stop string, a seeded sample, and one wanting
    logprobs (which needs the engine between its tokens, so plans that hold it run one step)."""
    future = tokenizer.encode(" future", add_special_tokens=False)
    return [SamplingParams(temperature=0, max_tokens=29, stop_token_ids=future),
            SamplingParams(temperature=0, max_tokens=40, stop=["Elena"]),
            SamplingParams(temperature=0.8, seed=3, max_tokens=21),
            SamplingParams(temperature=0, max_tokens=7, logprobs=2, ignore_eos=True)]


def _run(loaded, steps: int, stream: bool = False, **settings):
    engine = LLMEngine(EngineArgs(num_scheduler_steps=steps, enable_prefix_caching=False, **settings), loaded=loaded)
    records, pieces, finals = [], {}, {}
    engine.subscribe(records.append)
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params(loaded.tokenizer))):
        engine.add_request(prompt, params, request_id=str(i), stream=stream)
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces[out.request_id] = pieces.get(out.request_id, "") + out.new_text
            if out.finished:
                finals[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].text, out.outputs[0].finish_reason,
                                          out.outputs[0].logprobs)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "a plan's KV blocks leaked"
    return finals, records, pieces


def _token_id(loaded, text: str) -> int:
    (token,) = loaded.tokenizer.encode(text, add_special_tokens=False)
    return token


def _by_plan(records) -> list[list]:
    """The records grouped by the plan they belong to (a plan's records follow each other)."""
    plans, plan = [], []
    for r in records:
        assert r.plan_step == len(plan) < r.plan_steps
        plan.append(r)
        if len(plan) == r.plan_steps:
            plans.append(plan)
            plan = []
    assert not plan, "a plan's records are missing"
    return plans


def _plans(records):
    return [[(e.request_id, e.start, e.num_tokens, e.is_prefill) for e in r.entries] for r in records]


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_multi_step_plans_give_the_single_step_tokens_and_records(default_model, quantization):
    settings = {"dtype": "float32", "quantization": quantization}
    single, single_records, _ = _run(default_model, 1, **settings)
    multi, records, _ = _run(default_model, 4, **settings)
    assert multi == single
    assert _plans(records) == _plans(single_records)  # the same batches, step by step
    assert [r.index for r in records] == list(range(len(records)))
    assert {r.plan_steps for r in single_records} == {1}
    assert any(r.plan_steps > 1 for r in records), "no plan ran several steps"
    assert single["0"][2] == "stop" and single["0"][0][-1] == _token_id(default_model, " future")
    plan = next(p for p in _by_plan(records) if any("0" in r.finished for r in p))
    assert len(plan) > 1, "the stop token was not met inside a plan"
    assert "0" in plan[-1].finished, "a plan ran on past a stop token"
    for r in records:
        assert r.plan_steps == 1 or (r.kind == "decode" and "3" not in r.request_ids), "logprobs wait for the engine"
        assert r.duration_s > 0 and r.execute_s > 0


def test_multi_step_records_tile_the_call_and_streams_get_every_piece(default_model):
    finals, records, pieces = _run(default_model, 5, stream=True, dtype="float32")
    assert {rid: text for rid, (_, text, _, _) in finals.items()} == pieces
    tbt, plans = TimeBetweenTokens(window=100_000), _by_plan(records)
    assert any(len(plan) > 1 for plan in plans), "no plan ran several steps"
    for plan in plans:  # a plan's records follow each other without gaps
        for before, after in zip(plan, plan[1:]):
            assert after.start_time == pytest.approx(before.start_time + before.duration_s, abs=1e-9)
            assert after.plan_steps == before.plan_steps
        # the server's time between tokens: a plan's tokens after its first step reach their streams with it
        gaps = [g for r in plan for g in tbt.observe(r)]
        assert gaps.count(0.0) == sum(len(r.entries) for r in plan[1:])


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4"])
def test_num_scheduler_steps_must_be_a_whole_number_of_steps(bad):
    with pytest.raises(ValueError, match="num_scheduler_steps must be an integer >= 1"):
        EngineArgs(num_scheduler_steps=bad)


def test_multi_step_plans_are_refused_with_pipeline_stages_and_a_tbt_slo():
    with pytest.raises(ValueError, match="drop --num-scheduler-steps or --pipeline-parallel-size"):
        EngineArgs(num_scheduler_steps=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="drop --num-scheduler-steps or --tbt-slo-ms"):
        EngineArgs(num_scheduler_steps=2, tbt_slo_ms=100)


def test_multi_step_plans_under_a_tight_kv_cache_and_with_samples(default_model):
    """Plans take every step's blocks up front, so a tight cache runs shorter plans (or single steps) and
    preempts as it must; n=2 samples fork after their first token. The tokens stay those of one step a plan."""
    from charioteer import LLM

    from texts import prompt_ids

    prompts = [prompt_ids(default_model.tokenizer, 40 + 13 * i, offset=7 * i) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 5 + [
        SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=24, ignore_eos=True)]
    outputs, preemptions = {}, {}
    for steps in (1, 3):
        llm = LLM(default_model, dtype="float32", chunk_size=32, max_num_seqs=6, num_kv_blocks=14, block_size=16,
                  num_scheduler_steps=steps)
        records = []
        llm.engine.subscribe(records.append)
        outputs[steps] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        preemptions[steps] = llm.engine.scheduler.num_preemptions
        assert llm.engine.blocks.num_used_blocks == 0
        assert max(r.kv_blocks_used for r in records) <= 14
    assert outputs[3] == outputs[1]
    assert preemptions[1] > 0 and preemptions[3] > 0
    assert any(r.plan_steps > 1 for r in records), "no plan ran several steps"
