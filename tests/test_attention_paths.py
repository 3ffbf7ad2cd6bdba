"""Attention on contiguous cache rows (no copy) gives what the gathered-copy path gives."""
import dataclasses

import pytest
import torch

from charioteer import LLM, SamplingParams
from charioteer.engine.model_runner import ModelRunner, run_starts
from charioteer.memory.block_manager import BlockManager
from charioteer.model import cpu_kernels, llama
from charioteer.model.config import ModelConfig
from charioteer.request import Request


def _run(model, prompts, monkeypatch, min_bytes: int, fused: bool = False, **engine):
    """Generate; also return the decode attention path of each batch with decodes."""
    monkeypatch.setattr(llama, "DECODE_IN_PLACE_MIN_BYTES", min_bytes)
    # MKL's packed sgemm is not reproducible run to run with 2 threads (logprobs moved by up to
    # 3.5e-4 between two engines on the same plans): these tests compare attention paths, not it.
    monkeypatch.setenv("CHARIOTEER_PACKED_GEMM", "0")
    llm = LLM(model, max_num_seqs=4, **engine)
    model = llm.engine.runner.model
    if not fused:  # the decode attention kernel, and the one-call layers built on it, off
        model.kernels = dataclasses.replace(model.kernels, decode_attention=False, decode_layers=False)
    paths = []
    select = llama.select_paths
    monkeypatch.setattr(llama, "select_paths", lambda *args, **kw: paths.append(select(*args, **kw)) or paths[-1])
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=1))
    return outs, [p.decode_attention for p in paths if p.decode_attention is not None]


def _prompts():
    from texts import PASSAGE

    words = PASSAGE.split()
    return [" ".join(words[: 30 + 25 * i]) for i in range(5)]


def _assert_same(outs_a, outs_b):
    for a, b in zip(outs_a, outs_b):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            worst = max(abs(la[t] - lb[t]) for t in la)
            assert worst <= 1e-4, f"logprobs differ by {worst:.3g} at {la} against {lb}"


@pytest.mark.parametrize("kv_policy", ["reserve", "paged"])
def test_in_place_decode_matches_gathered(default_model, monkeypatch, kv_policy):
    engine = dict(chunk_size=24, kv_policy=kv_policy)
    in_place, used = _run(default_model, _prompts(), monkeypatch, 0, **engine)
    gathered, not_used = _run(default_model, _prompts(), monkeypatch, 1 << 60, **engine)
    if kv_policy == "reserve":
        assert "in_place" in used, "reserved KV is one contiguous run per request: the in-place path must run"
    assert set(not_used) == {"gathered"}
    _assert_same(in_place, gathered)


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")
@pytest.mark.parametrize("kv_policy", ["reserve", "paged"])
def test_fused_decode_attention_matches_gathered(default_model, monkeypatch, kv_policy):
    engine = dict(chunk_size=24, kv_policy=kv_policy)
    fused, decided = _run(default_model, _prompts(), monkeypatch, 1 << 60, fused=True, **engine)
    assert set(decided) == {"kernel"}, "the fused kernel serves every decode; the SDPA paths must not run"
    gathered, _ = _run(default_model, _prompts(), monkeypatch, 1 << 60, **engine)
    _assert_same(fused, gathered)


class _CountingRunner:
    def __init__(self, runner):
        self.runner, self.calls = runner, {"run": 0, "run_tokens": 0}

    def run(self, *args):
        self.calls["run"] += 1
        return self.runner.run(*args)

    def run_tokens(self, *args):
        self.calls["run_tokens"] += 1
        return self.runner.run_tokens(*args)


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")
@pytest.mark.parametrize("kv_policy, quantization, dtype", [("reserve", None, "float32"), ("paged", None, "float32"),
                                                           ("paged", "int8", "float32"),
                                                           ("paged", "int8-panel", "float32"),
                                                           ("paged", "gguf", "float32"),
                                                           ("paged", None, "bfloat16"),
                                                           ("paged", None, "bfloat16-unpacked"),
                                                           ("paged", None, "bfloat16-amx"),
                                                           ("paged", None, "bfloat16-avx512bf16")])
def test_one_call_decode_layers_are_bitwise_the_op_by_op_loop(default_model, kv_policy, quantization, dtype,
                                                              monkeypatch):
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3)
    if dtype.startswith("bfloat16"):  # widened, with oneDNN's bf16 GEMM from 2 rows, on any CPU: both GEMM paths run
        if dtype == "bfloat16-amx" and not cpu_kernels.amx_available():
            pytest.skip(f"AMX tiles: {cpu_kernels.amx_unavailable_reason()}")
        if dtype == "bfloat16-avx512bf16" and cpu_kernels.avx512_bf16_unavailable_reason() is not None:
            pytest.skip(f"AVX512-BF16 kernel: {cpu_kernels.avx512_bf16_unavailable_reason()}")
        monkeypatch.setenv("CHARIOTEER_ONEDNN_PACK", "0" if dtype == "bfloat16-unpacked" else "1")
        # one row on a tile-order kernel (AMX or AVX512-BF16, in its own variant only), else on the panel kernel
        monkeypatch.setenv("CHARIOTEER_AMX", "1" if dtype == "bfloat16-amx" else "0")
        monkeypatch.setenv("CHARIOTEER_AVX512_BF16", "1" if dtype == "bfloat16-avx512bf16" else "0")
        tile_kernel = {"bfloat16-amx": "amx", "bfloat16-avx512bf16": "avx512_bf16"}.get(dtype)
        dtype = "bfloat16"
        monkeypatch.setenv("CHARIOTEER_BF16_COMPUTE", "widened")
        monkeypatch.setattr(llama, "native_bf16_gemm", lambda device: True)
        monkeypatch.setattr(llama, "NATIVE_BF16_MIN_ROWS", 2)
        monkeypatch.setattr(llama, "AMX_MAX_ROWS", 1)
        monkeypatch.setattr(llama, "AVX512_BF16_MAX_ROWS", 1)
    else:
        tile_kernel = None
    if quantization in ("int8", "int8-panel"):  # AVX512-VNNI's kernel where it runs, or the panel kernel
        monkeypatch.setenv("CHARIOTEER_VNNI", "0" if quantization == "int8-panel" else "1")
        quantization = "int8"
    # no prefix caching: the second run must compute the same prompts again, not start on cached blocks
    llm = LLM(default_model, max_num_seqs=4, chunk_size=24, kv_policy=kv_policy, enable_prefix_caching=False,
              quantization=quantization, dtype=dtype)
    model = llm.engine.runner.model
    assert model.kernels.native_bf16_rows == (2 if dtype == "bfloat16" else 0)
    assert model.kernels.tile_kernel == tile_kernel
    model.decode_layers = counting = _CountingRunner(model.decode_layers)
    one_call = llm.generate(_prompts(), params)  # from the tokens to the final norm (run_tokens)
    model._tokens_in_one_call = False  # the layers alone (run), as a pipeline stage calls them
    layers_call = llm.generate(_prompts(), params)
    assert counting.calls["run_tokens"] > 0 and counting.calls["run"] > 0, "decode-only steps take the one call"
    model.kernels = dataclasses.replace(model.kernels, decode_layers=False)
    op_by_op = llm.generate(_prompts(), params)
    for a, b, c in zip(one_call, layers_call, op_by_op):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        # the same kernels in the same order: the same bits
        assert a.outputs[0].logprobs == b.outputs[0].logprobs == c.outputs[0].logprobs


def test_run_starts_needs_every_context_in_one_run_of_the_blocks_it_uses():
    assert run_starts([[3, 4, 5], [9, 10]], [40, 17], 16) == [48, 144]
    assert run_starts([[3, 4, 5], [9, 11]], [40, 17], 16) is None  # the second uses both its blocks
    assert run_starts([[3, 4, 5], [9, 11]], [40, 16], 16) == [48, 144]  # only its first
    assert run_starts([[3, 5, 4]], [48], 16) is None  # the right span in the wrong order


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
    from charioteer.request import SamplingParams

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

def _batch(num_prefills=0, num_decodes=0, lengths=True, runs=None) -> llama.ForwardInput:
    none = torch.zeros(0, dtype=torch.long)
    return llama.ForwardInput(
        token_ids=none, positions=none, slot_mapping=none,
        prefills=[llama.PrefillSpan(0, 1, 0, None, None)] * num_prefills, num_decodes=num_decodes,
        decode_slots=None, logits_rows=none, decode_runs=runs,
        decode_lengths=torch.ones(num_decodes, dtype=torch.long) if lengths else None)


def test_select_paths_table(monkeypatch):
    """Each row of select_paths' table, on any CPU: the choice is plain logic over the kernels and the batch."""
    config = ModelConfig(name="t", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1,
                         num_kv_heads=1)
    kv = llama.KVCache(config, 16, torch.device("cpu"))  # K and V of a position: 2 * 64 * 4 = 512 bytes
    monkeypatch.setattr(llama, "DECODE_IN_PLACE_MIN_BYTES", 512 * 10)
    on = llama.Kernels(panel_rows=32, packed_gemm=True, row_ops=True, decode_attention=True, decode_layers=True)
    off = dataclasses.replace(on, decode_attention=False, decode_layers=False)

    def paths(kernels, batch, profiled=False):
        p = llama.select_paths(kernels, batch, kv, profiled)
        return p.decode_layers, p.decode_attention

    assert paths(on, _batch(num_decodes=32)) == (True, "kernel")
    assert paths(on, _batch(num_decodes=33)) == (False, "kernel")
    assert paths(on, _batch(num_decodes=4), profiled=True) == (False, "kernel")
    assert paths(on, _batch(num_prefills=1, num_decodes=4)) == (False, "kernel")
    assert paths(on, _batch(num_prefills=1)) == (False, None)
    assert paths(on, _batch(num_decodes=4, lengths=False)) == (False, "gathered")
    assert paths(on, _batch(num_decodes=2, lengths=False, runs=[(0, 10), (10, 10)])) == (False, "in_place")
    assert paths(off, _batch(num_decodes=2, runs=[(0, 10), (10, 9)])) == (False, "gathered")  # mean 9.5 < 10
    assert paths(off, _batch(num_decodes=2, runs=[(0, 10), (10, 10)])) == (False, "in_place")
    assert paths(off, _batch(num_decodes=2)) == (False, "gathered")
    with pytest.raises(ValueError, match="needs both"):
        dataclasses.replace(off, decode_layers=True)


def test_kernels_choose_off_the_cpu_and_by_switch(monkeypatch):
    config = ModelConfig(name="t", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1,
                         num_kv_heads=1)
    assert llama.Kernels.choose(config, torch.device("cuda")) == llama.Kernels(0, False, False, False, False)
    cpu = llama.Kernels.choose(config, torch.device("cpu"))
    assert (cpu.panel_rows > 0) == cpu.row_ops == cpu.decode_attention == cpu.decode_layers == cpu_kernels.available()
    assert cpu.ops is (llama.NativeRowOps if cpu_kernels.available() else llama.TorchRowOps)
    monkeypatch.setenv("CHARIOTEER_PACKED_GEMM", "0")
    assert not llama.Kernels.choose(config, torch.device("cpu")).packed_gemm


def test_fp32_gemms_take_onednn_on_a_cpu_not_intels_and_the_switch_forces_either(monkeypatch):
    """MKL picks its code path by CPU vendor; oneDNN replaces its GEMMs above the panel kernel
    elsewhere (precision.onednn_fp32_gemm), for fp32 weights only, and never in the batch-invariant mode."""
    from charioteer.model.precision import onednn_fp32_gemm

    cpu, onednn = torch.device("cpu"), torch.backends.mkldnn.is_available()
    monkeypatch.delenv("CHARIOTEER_FP32_GEMM", raising=False)
    assert onednn_fp32_gemm(cpu, vendor="AuthenticAMD") == onednn
    assert not onednn_fp32_gemm(cpu, vendor="GenuineIntel") and not onednn_fp32_gemm(torch.device("cuda"), "AuthenticAMD")
    monkeypatch.setenv("CHARIOTEER_FP32_GEMM", "mkl")
    assert not onednn_fp32_gemm(cpu, vendor="AuthenticAMD")
    monkeypatch.setenv("CHARIOTEER_FP32_GEMM", "onednn")
    assert onednn_fp32_gemm(cpu, vendor="GenuineIntel") == onednn
    config = ModelConfig(name="t", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                         num_kv_heads=1)
    chosen = llama.Kernels.choose(config, cpu)
    assert chosen.onednn_fp32 == onednn and not (chosen.onednn_fp32 and chosen.packed_gemm)
    assert not llama.Kernels.choose(config, cpu, dtype=torch.bfloat16).onednn_fp32
    assert not llama.Kernels.choose(config, cpu, quantized=True).onednn_fp32
    assert not llama.Kernels.choose(config, cpu, batch_invariant=True).onednn_fp32
    monkeypatch.setenv("CHARIOTEER_FP32_GEMM", "fast")
    with pytest.raises(ValueError, match="auto, mkl, onednn"):
        llama.Kernels.choose(config, cpu)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN only where torch has it")
@pytest.mark.parametrize("rows", [1, 40, 300])
def test_a_linear_on_onednn_equals_f_linear_in_fp32(rows):
    torch.manual_seed(rows)
    weight, x = torch.randn(200, 96), torch.randn(rows, 96)
    linear = llama.Linear(weight, pack=False, onednn=True)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="not both"):
        llama.Linear(weight, pack=True, onednn=True)


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")
def test_a_decode_runner_of_the_first_layers_runs_what_a_model_of_those_layers_runs(default_model):
    """`decode_runner(2)` (what `bench single-stream --parts` times in the caches) is the first two layers' one call:
    the same bits as a model loaded with those two layers alone, on the same batch."""
    from charioteer.bench.batch_timer import BatchShape, BatchTimer
    from charioteer.model.loader import load_model

    hidden = []
    for llm, runner in ((LLM(default_model), 2), (LLM(load_model(num_layers=2)), None)):
        model = llm.engine.runner.model
        timer = BatchTimer(model, 64)
        inp, _, _ = timer.runner.prepare(timer.plan(BatchShape(decodes=(40, 17))))
        assert model.decodes_in_one_call(inp, timer.runner.kv)
        kv = timer.runner.kv.data
        hidden.append(model.run_decodes(inp, kv[:2], model.decode_runner(runner)) if runner
                      else model.run_decodes(inp, kv))
    assert len(hidden[0]) == 2 and torch.equal(hidden[0], hidden[1])
