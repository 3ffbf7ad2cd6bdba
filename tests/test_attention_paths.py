"""Attention on contiguous cache rows (no copy) gives what the gathered-copy path gives."""
import pytest

from charioteer import LLM, SamplingParams
from charioteer.engine.model_runner import ModelRunner
from charioteer.memory.block_manager import BlockManager
from charioteer.model import llama
from charioteer.request import Request


def _run(model, prompts, monkeypatch, min_bytes: int, **engine):
    monkeypatch.setattr(llama, "DECODE_IN_PLACE_MIN_BYTES", min_bytes)
    llm = LLM(model, max_num_seqs=4, **engine)
    calls = []
    decide = llama.LlamaModel._decode_in_place
    monkeypatch.setattr(llama.LlamaModel, "_decode_in_place",
                        staticmethod(lambda inp, k: calls.append(decide(inp, k)) or calls[-1]))
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=1))
    return outs, calls


@pytest.mark.parametrize("kv_policy", ["reserve", "paged"])
def test_in_place_decode_matches_gathered(default_model, monkeypatch, kv_policy):
    from texts import PASSAGE

    words = PASSAGE.split()
    prompts = [" ".join(words[: 30 + 25 * i]) for i in range(5)]
    engine = dict(chunk_size=24, kv_policy=kv_policy)
    in_place, used = _run(default_model, prompts, monkeypatch, 0, **engine)
    gathered, not_used = _run(default_model, prompts, monkeypatch, 1 << 60, **engine)
    if kv_policy == "reserve":
        assert any(used), "reserved KV is one contiguous run per request: the in-place path must run"
    assert not any(not_used)
    for a, b in zip(in_place, gathered):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert all(la[t] == pytest.approx(lb[t], abs=1e-4) for t in la)


def test_contiguous_start_only_for_consecutive_blocks():
    blocks = BlockManager(num_blocks=8, block_size=4)
    runner = ModelRunner(None, blocks)
    r = Request.__new__(Request)
    r.request_id = "r"
    entry = type("Entry", (), {"request": r})()
    blocks._tables["r"] = [3, 4, 5]
    assert runner._contiguous_start(entry, 12) == 12
    assert runner._contiguous_start(entry, 5) == 12  # only the blocks in use count
    blocks._tables["r"] = [3, 5, 4]
    assert runner._contiguous_start(entry, 12) is None
    assert runner._contiguous_start(entry, 4) == 12
