"""quantization="gguf": a GGUF file's own Q4_1 and Q8_0 blocks, kept, packed and multiplied as they are."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from charioteer import LLM, SamplingParams
from charioteer.model import cpu_kernels
from charioteer.model.gguf_blocks import BLOCK, BLOCK_BYTES, GGUFWeight, concat
from charioteer.model.llama import GGUFLinear, Linear

GGUF_KERNEL = cpu_kernels.gguf_unavailable_reason()
needs_kernel = pytest.mark.skipif(GGUF_KERNEL is not None, reason=f"GGUF kernel: {GGUF_KERNEL}")
each_isa = pytest.mark.parametrize("isa", [
    pytest.param(isa, marks=pytest.mark.skipif(cpu_kernels.load_reason(isa) is not None,
                                               reason=f"{isa} kernels: {cpu_kernels.load_reason(isa)}"))
    for isa in cpu_kernels.ISAS])


def test_the_default_files_blocks_dequantize_to_the_loaders_weights(default_model):
    """Every Q4_1 and Q8_0 weight of the file, Q and K with their rows un-permuted as the loader does."""
    loaded = default_model
    kinds = {w.kind for w in loaded.gguf_blocks.values()}
    assert kinds == {"Q4_1", "Q8_0"}  # the layers' linear weights, and the embedding (the tied LM head)
    assert loaded.gguf_blocks["model.embed_tokens.weight"].kind == "Q8_0"
    assert len(loaded.gguf_blocks) == 1 + 7 * loaded.config.num_layers
    for name, w in loaded.gguf_blocks.items():
        assert torch.equal(w.dequantize(), loaded.state_dict[name]), name


def test_blocks_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="kind 'Q4_K' is none of Q4_1, Q8_0"):
        GGUFWeight("Q4_K", torch.zeros(2, 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"Q4_1 rows must be uint8 \[rows, blocks \* 20\]"):
        GGUFWeight("Q4_1", torch.zeros(2, 21, dtype=torch.uint8))
    q41 = GGUFWeight("Q4_1", torch.zeros(2, 20, dtype=torch.uint8))
    q80 = GGUFWeight("Q8_0", torch.zeros(2, 34, dtype=torch.uint8))
    assert concat([q41, q41]).rows == 4
    assert concat([q41, q80]) is None and concat([q41, None]) is None  # a fused weight needs one kind throughout


def _random_blocks(kind: str, rows: int, blocks: int, rng: np.random.Generator) -> GGUFWeight:
    raw = rng.integers(0, 256, size=(rows, blocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, size=(rows, blocks, 2)).astype(np.float16)  # d (and m): finite, moderate
    raw[..., 0:2] = scales[..., :1].view(np.uint8)
    if kind == "Q4_1":
        raw[..., 2:4] = scales[..., 1:].view(np.uint8)
    return GGUFWeight(kind, torch.from_numpy(raw.reshape(rows, -1)))


def _kernel_model(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """The kernel's arithmetic in float64: x quantized per block of 32 as quantize_rows does (in fp32), the
    int16 products' exact sums, then d * scale * sum (+ m * the block's sum of x, added in fp32 in order)."""
    d, m, q = w._fields()
    xb = x.reshape(x.shape[0], -1, BLOCK)
    top = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.full_like(top, 32767.0) / top, torch.zeros_like(top))  # fp32, as the kernel
    xq = torch.clamp(torch.round(xb * inv), -32767, 32767).double()
    sums = torch.einsum("rbk,nbk->rnb", xq, q.double())
    y = (sums * d.double()[None] * (top / 32767.0).double().squeeze(-1)[:, None]).sum(-1)
    if m is not None:
        xsum = torch.zeros(xb.shape[:2])
        for i in range(BLOCK):  # as quantize_rows sums: one fp32 addition after another
            xsum = xsum + xb[..., i]
        y = y + (m.double()[None] * xsum.double()[:, None]).sum(-1)
    return y


@each_isa
@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["Q4_1", "Q8_0"]), rows=st.integers(1, 20), n=st.integers(1, 70),
       blocks=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), outlier=st.booleans())
def test_gguf_linear_is_the_block_product(isa, kind, rows, n, blocks, seed, outlier):
    """Against a float64 model of its arithmetic, and within half an int16 step of each block's largest |x|
    of the exact product on the dequantized weight; rows past a pass (8 or 4) and columns past a panel's 32
    included. Both builds give the same bits, and so do the AVX512-VNNI sums."""
    rng = np.random.default_rng(seed)
    w = _random_blocks(kind, n, blocks, rng)
    x = torch.from_numpy(rng.standard_normal((rows, blocks * BLOCK)).astype(np.float32))
    if outlier:
        x[0, 0] = 1000.0
    y = cpu_kernels.gguf_linear(x, w.pack(), n, isa=isa)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    for other in cpu_kernels.ISAS:
        if other != isa and cpu_kernels.load_reason(other) is None:
            assert torch.equal(cpu_kernels.gguf_linear(x, w.pack(), n, isa=other), y)
    if cpu_kernels.vnni_unavailable_reason(isa) is None:
        assert torch.equal(cpu_kernels.gguf_linear(x, w.pack(), n, vnni=True, isa=isa), y)
    d, m, q = w._fields()  # the kernel's two terms, d q x and m x, round apart: their own magnitudes
    terms = (d.double().abs()[..., None] * q.double().abs() + (0 if m is None else m.double().abs()[..., None]))
    magnitude = x.abs().double() @ terms.reshape(n, -1).T
    assert torch.all((y.double() - _kernel_model(x, w)).abs() <= 1e-6 * magnitude)
    steps = (x.abs().reshape(rows, blocks, BLOCK).amax(-1) / 32767).double()  # [rows, blocks]
    w_abs = w.dequantize().abs().double().reshape(n, blocks, BLOCK).sum(-1)  # [n, blocks]
    bound = 0.5 * steps @ w_abs.T + 1e-6 * magnitude
    assert torch.all((y.double() - x.double() @ w.dequantize().double().T).abs() <= bound)


@each_isa
def test_gguf_linear_rows_do_not_depend_on_their_batch(isa):
    rng = np.random.default_rng(1)
    w = _random_blocks("Q4_1", 40, 3, rng)
    packed = w.pack()
    x = torch.from_numpy(rng.standard_normal((11, 96)).astype(np.float32))
    batch = cpu_kernels.gguf_linear(x, packed, 40, isa=isa)
    for i in range(11):
        assert torch.equal(cpu_kernels.gguf_linear(x[i:i + 1], packed, 40, isa=isa), batch[i:i + 1])
    with pytest.raises(RuntimeError, match="x has 64 columns, the weight 96"):
        cpu_kernels.gguf_linear(x[:, :64].contiguous(), packed, 40, isa=isa)
    with pytest.raises(RuntimeError, match="n = 90 does not match the weight's 2 panels"):
        cpu_kernels.gguf_linear(x, packed, 90, isa=isa)
    if isa == "avx2":
        with pytest.raises(RuntimeError, match="vnni is in the avx512 build only"):
            cpu_kernels.gguf_linear(x, packed, 40, vnni=True, isa=isa)


def test_gguf_needs_a_gguf_file():
    with pytest.raises(ValueError, match="quantization='gguf' runs a GGUF file's own Q4_1 or Q8_0 blocks"):
        LLM("synthetic:tiny", quantization="gguf")


@pytest.mark.parametrize("kernel", ["on", "off"])
def test_gguf_runs_the_files_blocks_or_else_their_fp32_weights(default_model, kernel, monkeypatch):
    """With the kernel every linear layer and the LM head run the file's blocks, a step reading 0.63 bytes a
    weight; with CHARIOTEER_GGUF_KERNEL=0 (or no CPU kernels) they run as fp32 does, on the same weights
    dequantized, and give fp32's tokens."""
    monkeypatch.setenv("CHARIOTEER_GGUF_KERNEL", "1" if kernel == "on" else "0")
    llm = LLM(default_model, quantization="gguf", enable_prefix_caching=False)
    model = llm.engine.model
    runs = cpu_kernels.gguf_unavailable_reason() is None  # read after the switch is set
    assert model.kernels.gguf == runs
    assert all(isinstance(lin, GGUFLinear if runs else Linear) for layer in model.linears for lin in layer.values())
    assert isinstance(model.lm_head_linear, GGUFLinear if runs else Linear)
    fp32 = LLM(default_model, enable_prefix_caching=False)
    if runs:
        assert model.streamed_weight_bytes < 0.2 * fp32.engine.model.streamed_weight_bytes
    prompts = [fp32.tokenizer.encode("The tallest mountain on Earth is"), fp32.tokenizer.encode("1, 2, 3, 4,")]
    params = SamplingParams(temperature=0, max_tokens=12)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    reference = [o.outputs[0].token_ids for o in fp32.generate(prompts, params)]
    if not runs:
        assert ours == reference
    else:
        assert sum(a == b for x, y in zip(ours, reference) for a, b in zip(x, y)) >= 0.75 * sum(map(len, reference))


@needs_kernel
@pytest.mark.skipif(cpu_kernels.vnni_unavailable_reason() is not None,
                    reason=f"VNNI: {cpu_kernels.vnni_unavailable_reason()}")
def test_gguf_vnni_follows_its_switch_and_keeps_the_tokens(default_model, monkeypatch):
    """Where int8 would run VNNI, the GGUF kernel sums with it too, in the layers and the one-call decode
    alike; CHARIOTEER_VNNI=0 keeps vpmaddwd, with the same bits (so the same tokens)."""
    prompts = [[(7 * i + 3 * j) % 5000 + 100 for j in range(n)] for i, n in enumerate([9, 40, 4, 23])]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("CHARIOTEER_VNNI", switch)
        llm = LLM(default_model, quantization="gguf", chunk_size=16, enable_prefix_caching=False)
        kernels = llm.engine.model.kernels
        assert kernels.gguf and kernels.gguf_vnni == (switch == "1") and not kernels.int8_vnni
        assert all(lin.vnni == kernels.gguf_vnni for layer in llm.engine.model.linears for lin in layer.values())
        outputs[switch] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    assert outputs["1"] == outputs["0"]


@needs_kernel
def test_gguf_pipeline_stages_get_their_blocks_and_agree_with_one_process(default_model):
    """Each stage process receives its layers' blocks (and the last the LM head's) with its state dict."""
    prompts = [[(7 * i + 3 * j) % 5000 + 100 for j in range(n)] for i, n in enumerate([9, 40, 4, 23])]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    one = LLM(default_model, quantization="gguf", chunk_size=16, enable_prefix_caching=False)
    reference = [list(o.outputs[0].token_ids) for o in one.generate(prompts, params)]
    piped = LLM(default_model, quantization="gguf", chunk_size=16, enable_prefix_caching=False,
                pipeline_parallel_size=2)
    try:
        outputs = [list(o.outputs[0].token_ids) for o in piped.generate(prompts, params)]
    finally:
        piped.shutdown()
    assert outputs == reference  # every row's GEMMs depend on that row alone, in one process or two


@needs_kernel
def test_gguf_under_bf16_keeps_the_blocks_and_the_one_call_layers(default_model):
    """dtype bfloat16 with the GGUF kernel: bf16 KV cache and fp32 activations (widened bf16), the blocks
    for every GEMM (no oneDNN bf16 GEMMs), and decode steps still in one call."""
    llm = LLM(default_model, quantization="gguf", dtype="bfloat16", enable_prefix_caching=False)
    model = llm.engine.model
    assert model.kernels.gguf and model.kernels.native_bf16_rows == 0 and model.decode_layers is not None
    assert model.dtype == torch.bfloat16 and model.activation_dtype == torch.float32
    fp32 = LLM(default_model, quantization="gguf", enable_prefix_caching=False)
    prompt = fp32.tokenizer.encode("The tallest mountain on Earth is")
    params = SamplingParams(temperature=0, max_tokens=12)
    ours, reference = (list(x.generate([prompt], params)[0].outputs[0].token_ids) for x in (llm, fp32))
    assert sum(a == b for a, b in zip(ours, reference)) >= 6  # bf16's KV rounding may flip a near-tie late
