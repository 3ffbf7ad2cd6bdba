"""Attention on contiguous cache rows (no copy) gives what the gathered-copy path gives."""
import pytest

from charioteer import LLM, SamplingParams
from charioteer.engine.model_runner import ModelRunner
from charioteer.memory.block_manager import BlockManager
from charioteer.model import avx512, llama
from charioteer.request import Request


def _run(model, prompts, monkeypatch, min_bytes: int, fused: bool = False, **engine):
    monkeypatch.setattr(llama, "DECODE_IN_PLACE_MIN_BYTES", min_bytes)
    llm = LLM(model, max_num_seqs=4, **engine)
    llm.engine.runner.model.fused_decode_attention = fused
    calls = []
    decide = llama.LlamaModel._decode_in_place
    monkeypatch.setattr(llama.LlamaModel, "_decode_in_place",
                        staticmethod(lambda inp, k: calls.append(decide(inp, k)) or calls[-1]))
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=1))
    return outs, calls


def _prompts():
    from texts import PASSAGE

    words = PASSAGE.split()
    return [" ".join(words[: 30 + 25 * i]) for i in range(5)]


def _assert_same(outs_a, outs_b):
    for a, b in zip(outs_a, outs_b):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert all(la[t] == pytest.approx(lb[t], abs=1e-4) for t in la)


@pytest.mark.parametrize("kv_policy", ["reserve", "paged"])
def test_in_place_decode_matches_gathered(default_model, monkeypatch, kv_policy):
    engine = dict(chunk_size=24, kv_policy=kv_policy)
    in_place, used = _run(default_model, _prompts(), monkeypatch, 0, **engine)
    gathered, not_used = _run(default_model, _prompts(), monkeypatch, 1 << 60, **engine)
    if kv_policy == "reserve":
        assert any(used), "reserved KV is one contiguous run per request: the in-place path must run"
    assert not any(not_used)
    _assert_same(in_place, gathered)


@pytest.mark.skipif(not avx512.available(), reason=f"AVX-512 kernels: {avx512.unavailable_reason()}")
@pytest.mark.parametrize("kv_policy", ["reserve", "paged"])
def test_fused_decode_attention_matches_gathered(default_model, monkeypatch, kv_policy):
    engine = dict(chunk_size=24, kv_policy=kv_policy)
    fused, decided = _run(default_model, _prompts(), monkeypatch, 1 << 60, fused=True, **engine)
    assert not decided, "the fused kernel serves every decode; the SDPA paths must not run"
    gathered, _ = _run(default_model, _prompts(), monkeypatch, 1 << 60, **engine)
    _assert_same(fused, gathered)


class _CountingRunner:
    def __init__(self, runner):
        self.runner, self.calls = runner, 0

    def run(self, *args):
        self.calls += 1
        return self.runner.run(*args)


@pytest.mark.skipif(not avx512.available(), reason=f"AVX-512 kernels: {avx512.unavailable_reason()}")
@pytest.mark.parametrize("kv_policy", ["reserve", "paged"])
def test_one_call_decode_layers_are_bitwise_the_op_by_op_loop(default_model, kv_policy):
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3)
    llm = LLM(default_model, max_num_seqs=4, chunk_size=24, kv_policy=kv_policy)
    model = llm.engine.runner.model
    model.decode_layers = counting = _CountingRunner(model.decode_layers)
    one_call = llm.generate(_prompts(), params)
    assert counting.calls > 0, "decode-only steps must take the one-call path"
    model.decode_layers = None
    op_by_op = llm.generate(_prompts(), params)
    for a, b in zip(one_call, op_by_op):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # the same kernels in the same order: same bits


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


def _request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    from charioteer.sampling_params import SamplingParams

    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


def test_prefer_contiguous_blocks_after_mixed_frees():
    """Reservations of different sizes leave the free list fragmented; a new reservation still gets
    a consecutive run when one exists, and a growing request gets the block after its last."""
    blocks = BlockManager(num_blocks=12, block_size=4, policy="reserve", prefer_contiguous=True)
    small, big = _request("s", 6, 2), _request("b", 10, 6)  # 2 and 4 blocks
    blocks.admit(small, 6)
    blocks.admit(big, 10)
    assert blocks.block_table(small) == [0, 1] and blocks.block_table(big) == [2, 3, 4, 5]
    blocks.free(small)
    third = _request("t", 10, 6)
    blocks.admit(third, 10)
    assert blocks.block_table(third) == [6, 7, 8, 9]  # 0-1 is too short a run
    blocks.free(big)
    fourth = _request("f", 14, 6)  # 5 blocks: 0-5 is free again
    blocks.admit(fourth, 14)
    assert blocks.block_table(fourth) == [0, 1, 2, 3, 4]
    assert blocks.num_free_blocks == 12 - 9

    paged = BlockManager(num_blocks=8, block_size=4, policy="paged", prefer_contiguous=True)
    a, b = _request("a", 4, 8), _request("b", 4, 8)  # each may reach 3 blocks
    paged.admit(a, 4), paged.admit(b, 4)
    assert paged.ensure(a, 4) and paged.ensure(b, 4)
    assert paged.block_table(b) == [3]  # blocks 1-2 are a's room to grow
    assert paged.ensure(a, 8) and paged.ensure(b, 8) and paged.ensure(a, 12)
    assert paged.block_table(a) == [0, 1, 2] and paged.block_table(b) == [3, 4]

    # A cache too small for every room: requests still get blocks, just not consecutive ones.
    tight = BlockManager(num_blocks=4, block_size=4, policy="paged", prefer_contiguous=True)
    a, b = _request("a", 4, 8), _request("b", 4, 8)
    tight.admit(a, 4), tight.admit(b, 4)
    assert tight.ensure(a, 4) and tight.ensure(b, 4) and tight.ensure(a, 8) and tight.ensure(b, 8)
    assert tight.block_table(a) == [0, 1] and tight.block_table(b) == [3, 2]
    assert not tight.ensure(a, 12) and tight.num_free_blocks == 0
    tight.free(b)
    assert tight.ensure(a, 12) and tight.block_table(a) == [0, 1, 2]