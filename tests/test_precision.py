"""bfloat16 and weight-only int8: what `dtype="auto"` picks, the KV cache's bytes, and each format's
agreement with transformers and with fp32 on the real model, within the tolerance it states.

fp32's exactness (greedy outputs equal to transformers', the same under every policy and chunk
size) is tests/test_hf_parity.py's and tests/test_policies.py's; these are the lower precisions.
"""
from __future__ import annotations

import pytest
import torch

import transformers
from charioteer import LLM, SamplingParams
from charioteer.config import EngineArgs
from charioteer.model import cpu_kernels
from charioteer.model.llama import NARROW_PANEL_ROWS_FACTOR, Int8Linear
from charioteer.model.loader import save_hf_dir
from charioteer.model.precision import bf16_compute, native_bf16, native_bf16_gemm, quantize_int8, resolve_dtype
from test_hf_parity import CHATS
from texts import PASSAGE

NEW_TOKENS = 16
# bf16 keeps 8 bits of mantissa, so a logprob moves between two ways of summing the same row. Measured
# between a whole and a 24-token-chunked prefill on Zen 3 (max |diff|, mean): 0 on LONG_CHAT's 87 tokens;
# 0.17, 0.015 on 364; 0.18, 0.011 on 728; 0.18, 0.007 on 1456. The largest difference does not grow with
# the prompt past a few hundred tokens; this bound is tested on 728. On a Xeon with AMX, on 728 tokens:
# 0.21 through torch's bf16 ops, 0.25 widened with AMX GEMMs and bf16 prompt attention (0.21 with fp32
# prompt attention, which costs 10-15 % of a LLaMA-7B prefill there), 0.04 widened throughout. On
# Zen 4 (AVX512-BF16, no AMX), 728 tokens: 0.20 widened, 0.28 through torch's ops, 0.32 on the AVX2
# kernels with oneDNN's bf16 GEMM, one token past 0.15 (a last-bit difference in the fp32 row ops
# rounds an activation to the next bf16 value). The largest of 727 differences is one rounding
# flip; their mean, 0.017-0.022 on every path there, is the steadier check.
BF16_CHUNKED_LOGPROB_TOL = 0.4
BF16_CHUNKED_MEAN_LOGPROB_TOL = 0.03
# int8 weights with fp32 activations sum in fp32, as fp32 weights do: only the order of the
# attention's sums differs between a whole and a chunked prefill.
INT8_CHUNKED_LOGPROB_TOL = 1e-3
INT8_CHUNKED_MEAN_LOGPROB_TOL = 1e-4
# On a tile kernel (8 rows or more) int8's activations are quantized per row to int16 (AMX's int8 tiles) or
# rounded to bf16 (AVX512-BF16), so a difference in the last fp32 bit may move an input to the next value,
# as in bf16: bf16's bound. Measured on 728 tokens: 0 on a Xeon's int8 tiles (0.091 once when AMX rounded
# to bf16), 0 on a Zen 4 with AVX512-BF16 (whole and chunked prefill both run every GEMM on its kernel,
# whose rows do not depend on their batch); bounded by bf16's earlier 0.3, which no int8 run has come near.
INT8_TILES_CHUNKED_LOGPROB_TOL = 0.3
# Whether int8 weights run a tile kernel from 8 rows here (llama.Kernels.int8_tile_kernel).
INT8_TILES = cpu_kernels.int8_tile_kernel() is not None
# Greedy tokens that must agree before the first divergence, as a fraction of all tokens (the
# measured agreement is printed; a divergence ends a sequence's count, so this is a lower bound).
# bf16 on the 24 prompts below, 16 tokens, Xeon with AMX: transformers bf16 agrees with our fp32 at
# 0.77; ours with transformers bf16 at 0.75 through torch's ops, 0.75 widened with SDPA and 0.67
# widened with the AMX attention kernel, whose attention is the closer of the two to fp32 attention
# on the same bf16 inputs (mean |error| 0.00012 against SDPA's 0.00032 on these chats' layers): on
# another 24 prompts, 24 tokens, the two widened paths measured 0.68-0.76 and 0.70-0.73. A broken
# path (a wrong mask or row) agrees far less.
MIN_BF16_AGREEMENT_WITH_HF_BF16 = 0.6
MIN_INT8_AGREEMENT_WITH_FP32 = 0.6
# int8 weights under bf16 activations and KV (torch's int8 path: the CPU kernels off, or no native bf16 GEMM) carry
# both errors: on the Xeon with AMX and CHARIOTEER_CPU_KERNELS=off, 0.59, where int8 alone (fp32 activations)
# agrees at 0.78 and transformers bf16 with our fp32 at 0.77. A broken path agrees far less.
MIN_INT8_BF16_AGREEMENT_WITH_FP32 = 0.5
# quantization="gguf" multiplies the file's own weights, the ones fp32 runs dequantized; with
# CHARIOTEER_GGUF_INT8_ACTIVATIONS=0 its activations are quantized to int16 per block of 32 (about 1/65534 of the
# block's largest): only near-ties can differ.
MIN_GGUF_AGREEMENT_WITH_FP32 = 0.8
# By default the Q4_1 layers' activations are quantized to int8 per block of 32 (as llama.cpp's Q8_1): measured
# 0.78 on a Zen 4, 0.72 with its AVX2 build (int16: 1.00; llama.cpp 0.3.36 on the same file, 0.70 with its f16
# KV cache, 0.75 with f32), as int8 weights' 0.78. With m times the sum of x itself, not of the quantized x: 0.46.
# A wrong product agrees on next to nothing.
MIN_GGUF_INT8_ACTIVATIONS_AGREEMENT_WITH_FP32 = 0.6
GGUF_KERNEL = cpu_kernels.gguf_unavailable_reason() is None


def test_auto_takes_bf16_only_where_the_cpu_computes_it():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, flags={"avx2", "fma"}) == torch.float32
    assert resolve_dtype("auto", cpu, flags={"avx512f", "avx512_bf16"}) == torch.bfloat16
    assert resolve_dtype("auto", cpu, flags={"amx_bf16", "amx_tile"}) == torch.bfloat16
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native_bf16(cpu) else torch.float32)
    assert resolve_dtype("bfloat16", cpu, flags=set()) == torch.bfloat16


def test_bf16_computes_widened_on_a_cpu_with_native_gemms_where_it_has_bf16_arithmetic(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("CHARIOTEER_BF16_COMPUTE", raising=False)
    monkeypatch.delenv("CHARIOTEER_NATIVE_BF16_GEMM", raising=False)
    assert bf16_compute(cpu) == "widened"
    assert not native_bf16_gemm(cpu, flags={"avx2", "fma"})
    assert native_bf16_gemm(cpu, flags={"avx512f", "amx_bf16"})
    monkeypatch.setenv("CHARIOTEER_NATIVE_BF16_GEMM", "0")
    assert not native_bf16_gemm(cpu, flags={"avx512f", "amx_bf16"})
    monkeypatch.setenv("CHARIOTEER_BF16_COMPUTE", "torch")
    assert bf16_compute(cpu) == "torch"
    monkeypatch.setenv("CHARIOTEER_BF16_COMPUTE", "fp16")
    with pytest.raises(ValueError, match="CHARIOTEER_BF16_COMPUTE=fp16 is none of auto, widened, torch"):
        bf16_compute(cpu)


# Both ways bf16 runs, where this machine runs each: torch's bf16 ops, and widened (bf16 weights
# and KV, fp32 activations in the CPU kernels).
each_bf16_compute = pytest.mark.parametrize("compute", [
    "torch", pytest.param("widened", marks=pytest.mark.skipif(not cpu_kernels.available(),
                                                             reason="widened bf16 runs in the CPU kernels")),
    # where the CPU has AMX tiles, widened bf16 attends its prompts on them: this runs SDPA there instead
    pytest.param("widened-sdpa", marks=pytest.mark.skipif(not cpu_kernels.amx_available(),
                                                          reason="prompts attend on AMX tiles only where they run"))])


def _set_int8_tiles(monkeypatch, on: bool) -> None:
    """int8 on a tile kernel (from 8 rows) and AVX512-VNNI's (below) where they run (on), or on the panel
    kernel everywhere: every such kernel's switch."""
    for switch in ("CHARIOTEER_AMX_INT8", "CHARIOTEER_AVX512_BF16", "CHARIOTEER_VNNI"):
        monkeypatch.setenv(switch, "1" if on else "0")


def _set_bf16_compute(monkeypatch, compute: str) -> str:
    """Set the environment for `compute` (each_bf16_compute); returns CHARIOTEER_BF16_COMPUTE's value."""
    monkeypatch.setenv("CHARIOTEER_AMX_ATTENTION", "0" if compute == "widened-sdpa" else "1")
    compute = compute.removesuffix("-sdpa")
    monkeypatch.setenv("CHARIOTEER_BF16_COMPUTE", compute)
    return compute


def test_bad_precision_settings_say_what_to_change():
    with pytest.raises(ValueError, match="float32, bfloat16, auto"):
        EngineArgs(dtype="float16")
    with pytest.raises(ValueError, match="int8"):
        EngineArgs(quantization="int4")


def test_int8_linear_is_close_to_the_fp32_product():
    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(5, 64)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert torch.allclose(q.float() * scale[:, None], w, atol=float(scale.max()) / 2 + 1e-6)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        y = Int8Linear(w, dtype)(x.to(dtype)).float()
        exact = x.to(dtype).float() @ (q.float() * scale[:, None]).T  # the quantized weight's own product
        assert (y - exact).abs().max() <= tol * exact.abs().max()


@pytest.fixture(scope="module")
def prompts(default_model):
    """The parity chats and 19 requests about slices of a passage: greedy agreement in bf16 is decided
    by near-ties, a handful a prompt set, so a set of 5 moved it by 0.2 with the order of one sum."""
    llm = LLM(default_model)
    words = PASSAGE.split()
    passages = [{"role": "user", "content": "Explain: " + " ".join(words[i:i + 12 + i % 20])} for i in range(0, 19 * 9, 9)]
    return [llm.apply_chat_template(chat) for chat in CHATS + [[p] for p in passages]]


@pytest.fixture(scope="module")
def fp32_tokens(default_model, prompts):
    return _greedy(LLM(default_model), prompts)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.blocks.num_used_blocks == 0
    return [list(o.outputs[0].token_ids) for o in outs]


def _agreement(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """Tokens equal before each sequence's first divergence, over all tokens."""
    same = 0
    for ref, out in zip(reference, candidate):
        for a, b in zip(ref, out):
            if a != b:
                break
            same += 1
    return same / sum(map(len, reference))


@each_bf16_compute
def test_bf16_halves_the_kv_cache_and_runs_in_bf16(default_model, compute, monkeypatch):
    compute = _set_bf16_compute(monkeypatch, compute)
    fp32 = LLM(default_model, num_kv_blocks=64)
    bf16 = LLM(default_model, num_kv_blocks=64, dtype="bfloat16")
    model = bf16.engine.model
    assert model.kernels.widened_bf16 == (compute == "widened")
    assert model.activation_dtype == (torch.float32 if compute == "widened" else torch.bfloat16)
    assert bf16.engine.capacity()["activation_dtype"] == ("float32" if compute == "widened" else "bfloat16")
    cap32, cap16 = fp32.engine.capacity(), bf16.engine.capacity()
    assert (cap32["dtype"], cap16["dtype"]) == ("float32", "bfloat16")
    assert cap16["kv_bytes_per_token"] * 2 == cap32["kv_bytes_per_token"]
    assert bf16.engine.runner.kv.data.dtype == torch.bfloat16
    assert bf16.engine.model.linears[0]["qkv"].weight.dtype == torch.bfloat16
    # widened bf16 keeps the norms' weights (0.03 % of the model) in the activations' fp32
    assert cap32["weight_bytes"] <= cap16["weight_bytes"] * 2 <= cap32["weight_bytes"] * 1.001


BF16_TOLS = (BF16_CHUNKED_LOGPROB_TOL, BF16_CHUNKED_MEAN_LOGPROB_TOL)


@pytest.mark.parametrize("dtype, quantization, tolerance, compute", [
    ("bfloat16", None, BF16_TOLS, "torch"),
    pytest.param("bfloat16", None, BF16_TOLS, "widened",
                 marks=pytest.mark.skipif(not cpu_kernels.available(), reason="widened bf16 runs in the CPU kernels")),
    pytest.param("bfloat16", None, BF16_TOLS, "widened-sdpa",
                 marks=pytest.mark.skipif(not cpu_kernels.amx_available(), reason="AMX attention only where it runs")),
    ("float32", "int8", (INT8_CHUNKED_LOGPROB_TOL, INT8_CHUNKED_MEAN_LOGPROB_TOL), "panel"),
    pytest.param("float32", "int8", (INT8_TILES_CHUNKED_LOGPROB_TOL, BF16_CHUNKED_MEAN_LOGPROB_TOL), "tiles",
                 marks=pytest.mark.skipif(not INT8_TILES, reason="int8 on a tile kernel only where one runs")),
    # the GGUF kernel quantizes each row of x on its own, whole or chunked: only the attention's order differs
    pytest.param("float32", "gguf", (INT8_CHUNKED_LOGPROB_TOL, INT8_CHUNKED_MEAN_LOGPROB_TOL), "gguf",
                 marks=pytest.mark.skipif(not GGUF_KERNEL, reason="the GGUF kernel only where it runs"))])
def test_chunked_prefill_equals_a_whole_prefill_within_tolerance(default_model, dtype, quantization, tolerance, compute,
                                                                 monkeypatch):
    """`tolerance`: (the largest |logprob difference| over the prompt, their mean)."""
    amx_attention = compute == "widened" and cpu_kernels.amx_available()
    if quantization == "int8":
        _set_int8_tiles(monkeypatch, compute == "tiles")
    elif quantization is None:
        compute = _set_bf16_compute(monkeypatch, compute)
    # 728 tokens. int8 on the panel kernel: the whole prefill runs the weights dequantized (above the
    # panel kernel's rows), the 24-token chunks run them in the panel kernel; on AMX tiles, both.
    ids = LLM(default_model).tokenizer.encode(PASSAGE + " " + PASSAGE)
    assert len(ids) > NARROW_PANEL_ROWS_FACTOR * cpu_kernels.PANEL_MAX_ROWS["avx2"]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    runs = []
    for chunk in (1024, 24):
        llm = LLM(default_model, dtype=dtype, quantization=quantization, chunk_size=chunk)
        assert llm.engine.model.kernels.amx_attention == amx_attention
        assert bool(llm.engine.model.kernels.int8_tile_rows) == (compute == "tiles")
        assert llm.engine.model.kernels.gguf == (quantization == "gguf")
        out = llm.generate(ids, params)[0]
        runs.append([entry[ids[i]] for i, entry in enumerate(out.prompt_logprobs) if i > 0])
    diffs = [abs(a - b) for a, b in zip(*runs)]
    largest, mean = max(diffs), sum(diffs) / len(diffs)
    print(f"\n[{dtype}, {quantization}, {compute}] whole vs chunked prefill of {len(ids)} tokens: "
          f"|logprob diff| max {largest:.2g}, mean {mean:.2g}")
    assert largest < tolerance[0] and mean < tolerance[1]


@each_bf16_compute
def test_bf16_greedy_agrees_with_transformers_in_bf16(default_model, prompts, fp32_tokens, tmp_path, compute,
                                                      monkeypatch):
    # From a safetensors folder of the same weights: transformers keeps a GGUF's weights quantized
    # and computes in fp32 whatever dtype it is given, which would not be bf16 at all.
    save_hf_dir(default_model, str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    _set_bf16_compute(monkeypatch, compute)
    ours = _greedy(LLM(default_model, dtype="bfloat16", chunk_size=16), prompts)
    reference = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None)
            reference.append(out[0, len(p):].tolist())
    with_hf, with_fp32 = _agreement(reference, ours), _agreement(fp32_tokens, ours)
    print(f"\n[bf16, {compute}] greedy agreement: {with_hf:.2f} with transformers bf16, {with_fp32:.2f} with our fp32, "
          f"transformers bf16 with our fp32 {_agreement(fp32_tokens, reference):.2f}")
    assert with_hf >= MIN_BF16_AGREEMENT_WITH_HF_BF16


@pytest.mark.parametrize("dtype, int8_tiles", [("float32", True), ("float32", False), ("bfloat16", True)])
def test_int8_greedy_agrees_with_fp32(default_model, prompts, fp32_tokens, dtype, int8_tiles, monkeypatch):
    _set_int8_tiles(monkeypatch, int8_tiles)
    llm = LLM(default_model, quantization="int8", dtype=dtype, chunk_size=16)
    # the 16-token chunks run on a tile kernel where one runs and its switch is not 0
    # (asked after the switches are set: INT8_TILES read the environment the run started in)
    fp32_activations = llm.engine.model.activation_dtype == torch.float32
    tiles = int8_tiles and cpu_kernels.int8_tile_kernel() is not None and fp32_activations
    assert bool(llm.engine.model.kernels.int8_tile_rows) == tiles
    vnni = int8_tiles and cpu_kernels.vnni_unavailable_reason() is None and fp32_activations
    assert llm.engine.model.kernels.int8_vnni == vnni
    kernels = llm.engine.capacity()["kernels"]  # charioteer info
    assert (kernels["int8_tile_rows"], kernels["int8_tile_kernel"]) == (
        llm.engine.model.kernels.int8_tile_rows, llm.engine.model.kernels.int8_tile_kernel)
    weights = llm.engine.model.linears[0]["gate_up"]
    assert isinstance(weights, Int8Linear) and weights.weight.dtype == torch.int8
    # fp32 activations (also widened bf16's) run the int8 panel kernel where the CPU kernels are; bf16
    # ones torch's int8 GEMM
    assert fp32_activations == (dtype == "float32" or llm.engine.model.kernels.widened_bf16)
    assert (weights.panels is not None) == (fp32_activations and cpu_kernels.available())
    agreement = _agreement(fp32_tokens, _greedy(llm, prompts))
    print(f"\n[int8, {dtype} activations, tile kernel {llm.engine.model.kernels.int8_tile_kernel}, VNNI {vnni}] "
          "greedy agreement "
          f"with fp32: {agreement:.2f}")
    assert agreement >= (MIN_INT8_AGREEMENT_WITH_FP32 if fp32_activations else MIN_INT8_BF16_AGREEMENT_WITH_FP32)


@pytest.mark.skipif(not GGUF_KERNEL, reason=f"GGUF kernel: {cpu_kernels.gguf_unavailable_reason()}")
def test_gguf_int16_activations_agree_with_fp32(default_model, prompts, fp32_tokens, monkeypatch):
    monkeypatch.setenv("CHARIOTEER_GGUF_INT8_ACTIVATIONS", "0")
    llm = LLM(default_model, quantization="gguf", chunk_size=16)
    assert llm.engine.model.kernels.gguf and llm.engine.model.decode_layers is not None
    assert not llm.engine.model.kernels.gguf_int8_activations
    agreement = _agreement(fp32_tokens, _greedy(llm, prompts))
    print(f"\n[gguf: Q4_1 layers, Q8_0 LM head, int16 activations] greedy agreement with fp32: {agreement:.2f}")
    assert agreement >= MIN_GGUF_AGREEMENT_WITH_FP32


@pytest.mark.skipif(not GGUF_KERNEL, reason=f"GGUF kernel: {cpu_kernels.gguf_unavailable_reason()}")
def test_gguf_int8_activations_agree_with_fp32_less(default_model, prompts, fp32_tokens, monkeypatch):
    monkeypatch.delenv("CHARIOTEER_GGUF_INT8_ACTIVATIONS", raising=False)  # the default
    llm = LLM(default_model, quantization="gguf", chunk_size=16)
    assert llm.engine.model.kernels.gguf_int8_activations and llm.engine.model.decode_layers is not None
    assert llm.engine.model.linears[0]["qkv"].panels.dim() == 4  # the Q4_1 layers' int8-activation records
    assert llm.engine.model.lm_head_linear.panels.dim() == 3  # the Q8_0 LM head keeps int16 activations
    agreement = _agreement(fp32_tokens, _greedy(llm, prompts))
    print(f"\n[gguf, int8 activations in the Q4_1 layers] greedy agreement with fp32: {agreement:.2f}")
    assert agreement >= MIN_GGUF_INT8_ACTIVATIONS_AGREEMENT_WITH_FP32


@pytest.mark.parametrize("spec", ["synthetic:tiny",  # head_dim 32: torch's bf16 ops
                                  "synthetic:vocab=512,hidden=256,intermediate=512,layers=4,heads=4,context=512"])
def test_bf16_pipeline_stages_run_bf16_and_agree_with_one_process(spec):
    """With head_dim 64 bf16 runs widened where the CPU kernels run: fp32 hidden states pass between
    the stages."""
    from charioteer.model.loader import load_model

    tiny_model = load_model(spec)
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate([9, 40, 4, 23])]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    one = LLM(tiny_model, dtype="bfloat16", chunk_size=8)
    widened = (tiny_model.config.head_dim in cpu_kernels.HEAD_DIMS and cpu_kernels.available()
               and bf16_compute(torch.device("cpu")) == "widened")
    assert one.engine.model.kernels.widened_bf16 == widened
    piped = LLM(tiny_model, dtype="bfloat16", chunk_size=8, pipeline_parallel_size=2)
    try:
        assert piped.engine.capacity()["kv_bytes_per_token"] * 2 == LLM(tiny_model).engine.capacity()["kv_bytes_per_token"]
        reference = [list(o.outputs[0].token_ids) for o in one.generate(prompts, params)]
        outputs = [list(o.outputs[0].token_ids) for o in piped.generate(prompts, params)]
        assert piped.engine.blocks.num_used_blocks == 0
    finally:
        piped.shutdown()
    # One process and the stages run the same bf16 ops on different thread counts.
    assert _agreement(reference, outputs) >= 0.9


def test_bench_single_stream_reports_each_format_against_its_bytes(capsys):
    import json

    from charioteer.bench.roofline import last_level_cache_bytes
    from charioteer.cli import main

    # heads of 64 values, which the one-call decode's attention kernel takes (--parts times that call)
    rc = main(["bench", "single-stream", "--model", "synthetic:tiny,heads=2,kv_heads=1", "--json", "--formats",
               "float32,bfloat16,int8",
               "--prompt-len", "16", "--new-tokens", "4", "--repeats", "2", "--scheduler-steps", "1,3", "--parts"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["format"]: r for r in out["rows"]}
    assert set(rows) == {"float32", "bfloat16", "int8", "float32@3", "bfloat16@3", "int8@3"}
    # each format at 3 steps a plan against itself at one, the others against the first
    assert out["comparisons"] == [["float32@3", "float32"], ["bfloat16", "float32"], ["bfloat16@3", "bfloat16"],
                                  ["int8", "float32"], ["int8@3", "int8"]]
    assert rows["int8@3"]["streamed_mb"] == rows["int8"]["streamed_mb"]
    assert out["int8@3_over_int8_verdict"] in {"faster", "slower", "not distinguishable"}
    # int8 weights are a quarter of fp32's bytes (plus a scale per row), bf16 half: the KV's share is small
    assert rows["int8"]["streamed_mb"] < rows["bfloat16"]["streamed_mb"] < rows["float32"]["streamed_mb"]
    for row in rows.values():
        # a tiny model's weights stay in cache: its "reads" may beat the memory, and then get no fraction
        assert row["step_ms"] > 0 and row["limit_tok_s"] > 0 and (row["of_limit"] is None or 0 < row["of_limit"] <= 1)
        assert row["step_ms_spread"][0] <= row["step_ms"] <= row["step_ms_spread"][1]
        # against the bandwidth read in the same rounds, held to the round's fastest step from memory: a fraction,
        # unless the format fits in the last-level cache (a tiny model does), whose steps may beat the memory
        assert row["fits_last_level_cache"] == (row["streamed_mb"] * 1e6 <= last_level_cache_bytes())
        assert 0 < row["of_round_limit_spread"][0] <= row["of_round_limit"] <= row["of_round_limit_spread"][1]
        assert row["fits_last_level_cache"] or row["of_round_limit_spread"][1] <= 1
    low, high = out["round_bandwidth_gbs_spread"]
    assert 0 < low <= out["round_bandwidth_gbs"] <= high <= out["memory_bandwidth_gbs"]
    assert out["int8_over_float32_verdict"] in {"faster", "slower", "not distinguishable"}
    assert out["cpu_features"] is not None
    # each format's step taken apart once a round, on its first run's engine, where it runs in one call
    parts = {r["format"]: r for r in out["parts"]}
    assert set(parts) == ({"float32", "int8"} | ({"bfloat16"} if "bfloat16" in parts else set())
                          if cpu_kernels.available() else set())
    for row in parts.values():
        for name in ("layers_ms", "head_ms", "cached_layer_us"):
            assert 0 < row[name + "_spread"][0] <= row[name] <= row[name + "_spread"][1]
        assert row["layers_of_round"] > 0 and row["head_of_round"] > 0
        assert row["around_ms_spread"][0] <= row["around_ms"] <= row["around_ms_spread"][1]


def test_bench_switch_runs_both_sides_of_a_switch_and_says_what_it_changed(capsys, monkeypatch):
    import json
    import os

    from charioteer.cli import main

    monkeypatch.delenv("CHARIOTEER_VNNI", raising=False)
    vnni = cpu_kernels.vnni_unavailable_reason() is None
    rc = main(["bench", "switch", "--model", "synthetic:tiny", "--json", "--env", "CHARIOTEER_VNNI",
               "--quantization", "int8", "--requests", "3", "--prompt-len", "8", "--new-tokens", "3", "--repeats", "2"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert "CHARIOTEER_VNNI" not in os.environ  # restored after the engines are built
    assert out["kernels_changed"] == ({"int8_vnni": [True, False]} if vnni else {})
    assert isinstance(out["same_tokens"], bool)  # VNNI quantizes x, the panel kernel does not: either may be
    for side in ("on", "off"):
        low, high = out[f"{side}_tok_s_spread"]
        assert 0 < low <= out[f"{side}_tok_s"] <= high
    assert out["on_over_off_verdict"] in {"faster", "slower", "not distinguishable"}
    assert main(["bench", "switch", "--model", "synthetic:tiny", "--env", "VNNI"]) != 0
    assert "--env must name one of Charioteer's switches (CHARIOTEER_...), got 'VNNI'" in capsys.readouterr().err
    assert main(["bench", "switch", "--model", "synthetic:tiny", "--env", "CHARIOTEER_VNNI", "--off", "1"]) != 0
    assert "--on and --off must differ, both are '1'" in capsys.readouterr().err


def test_bench_single_stream_refuses_an_unknown_format(capsys):
    from charioteer.cli import main

    assert main(["bench", "single-stream", "--model", "synthetic:tiny", "--formats", "float32,int4"]) != 0
    assert "--formats: unknown int4; choose from float32, bfloat16, int8, gguf" in capsys.readouterr().err
    for bad in ("0", "1,x", "2,2", ""):
        assert main(["bench", "single-stream", "--model", "synthetic:tiny", "--scheduler-steps", bad]) != 0
        assert f"--scheduler-steps takes distinct integers >= 1, comma-separated, got {bad!r}" in capsys.readouterr().err
