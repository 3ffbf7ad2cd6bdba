"""quantization="gguf": a GGUF file's own blocks, kept, packed and multiplied as they are."""
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from charioteer import LLM, SamplingParams
from charioteer.model import cpu_kernels
from charioteer.model.gguf_blocks import (BLOCK, BLOCK_BYTES, IQ4_VALUES, KINDS, MIXED_FORM, BlockWeight, FusedWeight,
                                          GGUFWeight, concat, five_bit_records, int8_activation_records, per_value)
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
    with pytest.raises(ValueError, match="kind 'TQ1_0' is none of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q3_K, Q4_K"):
        GGUFWeight("TQ1_0", torch.zeros(2, 54, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"Q4_1 rows must be uint8 \[rows, blocks \* 20\]"):
        GGUFWeight("Q4_1", torch.zeros(2, 21, dtype=torch.uint8))
    q41 = GGUFWeight("Q4_1", torch.zeros(2, 20, dtype=torch.uint8))
    q80 = GGUFWeight("Q8_0", torch.zeros(2, 34, dtype=torch.uint8))
    assert concat([q41, q41]).rows == 4 and concat([q41, q41]).form == q41.form
    assert concat([q41, None]) is None  # a part not in blocks
    assert concat([q41, GGUFWeight("Q4_1", torch.zeros(2, 40, dtype=torch.uint8))]) is None  # other columns
    assert concat([q41, q80]).form == MIXED_FORM  # no common form: int8 q, two d and two m, all fp32
    q50 = GGUFWeight("Q5_0", torch.zeros(3, 22, dtype=torch.uint8))
    q40 = GGUFWeight("Q4_0", torch.zeros(2, 18, dtype=torch.uint8))
    assert concat([q50, q80]).rows == 5 and concat([q50, q80]).form[0] == 8  # 5-bit q run as int8 beside 8-bit
    assert concat([q40, q41]).form == MIXED_FORM  # 4-bit both, but Q4_0 runs with fp32 scales
    q51 = GGUFWeight("Q5_1", torch.zeros(2, 24, dtype=torch.uint8))
    assert concat([q51, q40]).form == (5, True, torch.float32, 1)  # 4-bit q with fp32 d and m fit Q5_1's records
    iq4 = GGUFWeight("IQ4_NL", torch.zeros(2, 18, dtype=torch.uint8))
    assert concat([iq4, q80]).form == (8, False, torch.float16, 1)


@needs_kernel
@each_isa
def test_q5_0_in_5_bit_or_int8_records_gives_the_same_bits(isa, monkeypatch):
    """Q5_0 packs into its own 5-bit records where the AVX-512 build runs, else into int8 ones (the AVX2 build
    emulates the mask); CHARIOTEER_GGUF_5BIT forces either. The same values, so the same sums and bits."""
    w = _random_blocks("Q5_0", 40, 3, np.random.default_rng(2))
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((3, w.cols)).astype(np.float32))
    five, eight = w.pack(five_bits=True), w.pack(five_bits=False)
    assert five.shape[-1] == 704 and eight.shape[-1] == 1088
    assert torch.equal(cpu_kernels.gguf_linear(x, five, 40, isa=isa), cpu_kernels.gguf_linear(x, eight, 40, isa=isa))
    assert five_bit_records() == (cpu_kernels.chosen_isa() == "avx512")
    for setting, packed in (("1", five), ("0", eight)):
        monkeypatch.setenv("CHARIOTEER_GGUF_5BIT", setting)
        assert torch.equal(w.pack(), packed)
    monkeypatch.setenv("CHARIOTEER_GGUF_5BIT", "yes")
    with pytest.raises(ValueError, match="CHARIOTEER_GGUF_5BIT=yes is none of 0, 1, auto"):
        w.pack()


@needs_kernel
@each_isa
def test_fused_parts_of_any_kinds_run_as_each_alone(isa, monkeypatch):
    """Q5_1 and Q5_K (unsigned 5-bit q with an m: no int8 form of their own) take 5-bit records in either build,
    whatever CHARIOTEER_GGUF_5BIT says, and a Q4_K part fuses into them; parts with no common form (a Q6_K V
    beside them) fuse into the mixed records. Each part's columns are its own product, within the rounding of
    its d split per 16 values in the mixed records."""
    monkeypatch.setenv("CHARIOTEER_GGUF_INT8_ACTIVATIONS", "0")  # a Q4_K part alone in int16 x, as fused
    rng = np.random.default_rng(6)
    parts = [_random_blocks(kind, 24, b, rng) for kind, b in (("Q5_1", 16), ("Q5_K", 2), ("Q4_K", 2), ("Q6_K", 2))]
    x = torch.from_numpy(rng.standard_normal((3, 512)).astype(np.float32))
    for setting in ("0", "1"):
        monkeypatch.setenv("CHARIOTEER_GGUF_5BIT", setting)
        assert {w.pack().shape[-1] for w in parts[:2]} == {896}
    alone = [cpu_kernels.gguf_linear(x, w.pack(), 24, isa=isa) for w in parts]
    five = concat(parts[:3])
    assert five.form == (5, True, torch.float32, 1) and five.pack().shape[-1] == 896
    assert torch.equal(cpu_kernels.gguf_linear(x, five.pack(), 72, isa=isa), torch.cat(alone[:3], dim=1))
    mixed = concat(parts)
    assert mixed.form == MIXED_FORM and mixed.pack().shape[-1] == 1536
    assert torch.equal(mixed.dequantize(), torch.cat([w.dequantize() for w in parts]))
    y = cpu_kernels.gguf_linear(x, mixed.pack(), 96, isa=isa)
    assert torch.equal(y[:, 72:], alone[3])  # Q6_K's own d per 16 values
    assert torch.all((y[:, :72] - torch.cat(alone[:3], dim=1)).abs() <= 1e-6 * _magnitude(x, five))


def _random_blocks(kind: str, rows: int, blocks: int, rng: np.random.Generator, scale: float = 0.05) -> GGUFWeight:
    """`blocks` of the file's blocks per row (256 values each but for the 32 of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
    IQ4_NL), random but for finite scales (d and m or dmin up to `scale`)."""
    raw = rng.integers(0, 256, size=(rows, blocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = rng.uniform(-scale, scale, size=(rows, blocks, 2)).astype(np.float16)
    d_at, m_at = {"Q6_K": (208, None), "Q3_K": (108, None), "Q2_K": (80, 82)}.get(kind, (0, 2))  # fp16 d, m or dmin
    raw[..., d_at:d_at + 2] = scales[..., :1].view(np.uint8)
    if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K"):
        raw[..., m_at:m_at + 2] = scales[..., 1:].view(np.uint8)
    if kind == "IQ1_M":  # its d's four nibbles are the top nibbles of the four uint16 at byte 48
        d = scales[..., 0].view(np.uint16).astype(np.uint16)
        words = raw[..., 48:56].copy().view(np.uint16) & 0x0FFF
        raw[..., 48:56] = (words | np.stack([(d >> 4 * i & 0xF) << 12 for i in range(4)], -1)).view(np.uint8)
    return GGUFWeight(kind, torch.from_numpy(raw.reshape(rows, -1)))


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_dequantizes_as_gguf_py_does(kind):
    """The loader's fp32 weights come from gguf-py's dequantize: the kernel forms hold exactly those values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = _random_blocks(kind, 5, 3, np.random.default_rng(3))
    reference = dequantize(w.data.numpy(), GGMLQuantizationType[kind])
    assert w.cols == reference.shape[1] and torch.equal(w.dequantize(), torch.from_numpy(reference))
    d, m, q = w.fields()
    assert d.shape[:2] == (5, w.cols // BLOCK) and q.shape == (5, w.cols // BLOCK, BLOCK)
    assert (m is not None, d.dtype, 1 if d.dim() == 2 else d.shape[2]) == w.form[1:]
    fused = concat([w, w])
    assert isinstance(fused, FusedWeight) and torch.equal(fused.dequantize(), w.dequantize().repeat(2, 1))


def _magnitude(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """[rows, n]: the sizes of the kernel's terms, d q x and m x (each rounds apart), summed in float64."""
    d, m, q = w.fields()
    terms = (per_value(d.double()).abs() * q.double().abs() + (0 if m is None else per_value(m.double()).abs()))
    return x.abs().double() @ terms.reshape(w.rows, -1).T


def _kernel_model(x: torch.Tensor, w: GGUFWeight, levels: float = 32767.0) -> torch.Tensor:
    """The kernel's arithmetic in float64: x quantized per block of 32 as quantize_rows does (in fp32; to int16,
    or with `levels` 127 to int8), the integer products' exact sums, then d * scale * sum (+ m * the sum of the
    quantized x over its block, or over its 16 values in the mixed form: the integer sum times the scale in fp32)."""
    d, m, q = w.fields()
    xb = x.reshape(x.shape[0], -1, BLOCK)
    top = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.full_like(top, levels) / top, torch.zeros_like(top))  # fp32, as the kernel
    xq = torch.clamp(torch.round(xb * inv), -levels, levels).double()
    scale = top / levels  # fp32, as the kernel
    sums = torch.einsum("rbk,nbk->rnb", xq, q.double() * per_value(d.double()))
    y = (sums * scale.double().squeeze(-1)[:, None]).sum(-1)
    if m is not None:
        sets = 1 if m.dim() == 2 else m.shape[2]  # m per block of 32 or per 16 values
        xsum = xq.reshape(*xq.shape[:2], sets, BLOCK // sets).sum(-1).float() * scale  # exact integers, then fp32
        y = y + (m.double().reshape(*m.shape[:2], sets)[None] * xsum.double()[:, None]).sum((-1, -2))
    return y


@each_isa
@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(KINDS), rows=st.integers(1, 20), n=st.integers(1, 70),
       blocks=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), outlier=st.booleans())
def test_gguf_linear_is_the_block_product(isa, kind, rows, n, blocks, seed, outlier):
    """Against a float64 model of its arithmetic, and within half an int16 step of each block's largest |x|
    of the exact product on the dequantized weight (an int8 step for the 4-bit forms packed for int8
    activations); rows past a pass (8 or 4) and columns past a panel's 32 included. Both builds give the same
    bits, and so do the AVX512-VNNI sums."""
    _check_block_product(isa, kind, rows, n, blocks, seed, outlier)


@each_isa
@pytest.mark.parametrize("kind", KINDS)
def test_gguf_linear_is_the_block_product_for_every_kind(isa, kind):
    """The same checks on one shape per kind, so that none is left to the draw above."""
    _check_block_product(isa, kind, rows=9, n=40, blocks=2, seed=11, outlier=True)


def _check_block_product(isa: str, kind: str, rows: int, n: int, blocks: int, seed: int, outlier: bool) -> None:
    rng = np.random.default_rng(seed)
    w = _random_blocks(kind, n, blocks, rng)
    blocks = w.cols // BLOCK  # the kernel's blocks of 32 (a Q4_K block holds 8)
    x = torch.from_numpy(rng.standard_normal((rows, w.cols)).astype(np.float32))
    if outlier:
        x[0, 0] = 1000.0
    for int8_x in (False, True) if w.form[0] == 4 else (False,):
        packed = w.pack(five_bits=True, int8_activations=int8_x)  # Q5_0's own records in either build
        assert packed.dim() == (4 if int8_x else 3)
        y = cpu_kernels.gguf_linear(x, packed, n, isa=isa)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        for other in cpu_kernels.ISAS:
            if other != isa and cpu_kernels.load_reason(other) is None:
                assert torch.equal(cpu_kernels.gguf_linear(x, packed, n, isa=other), y)
        if cpu_kernels.vnni_unavailable_reason(isa) is None:
            assert torch.equal(cpu_kernels.gguf_linear(x, packed, n, vnni=True, isa=isa), y)
        levels = 127.0 if int8_x else 32767.0
        magnitude = _magnitude(x, w)
        assert torch.all((y.double() - _kernel_model(x, w, levels)).abs() <= 1e-6 * magnitude)
        steps = (x.abs().reshape(rows, blocks, BLOCK).amax(-1) / levels).double()  # [rows, blocks]
        w_abs = w.dequantize().abs().double().reshape(n, blocks, BLOCK).sum(-1)  # [n, blocks]
        bound = 0.5 * steps @ w_abs.T + 1e-6 * magnitude
        assert torch.all((y.double() - x.double() @ w.dequantize().double().T).abs() <= bound)


@each_isa
def test_gguf_linear_rows_do_not_depend_on_their_batch(isa):
    rng = np.random.default_rng(1)
    w = _random_blocks("Q4_1", 40, 3, rng)
    packed = w.pack(int8_activations=False)
    x = torch.from_numpy(rng.standard_normal((11, 96)).astype(np.float32))
    for records in (packed, w.pack(int8_activations=True)):
        batch = cpu_kernels.gguf_linear(x, records, 40, isa=isa)
        for i in range(11):
            assert torch.equal(cpu_kernels.gguf_linear(x[i:i + 1], records, 40, isa=isa), batch[i:i + 1])
    with pytest.raises(RuntimeError, match="the weight must come from BlockWeight.pack"):
        cpu_kernels.gguf_linear(x, packed.reshape(2, 3, -1, 64), 40, isa=isa)
    with pytest.raises(RuntimeError, match="the weight must come from BlockWeight.pack"):  # no int8-x 5-bit form
        cpu_kernels.gguf_linear(x, _random_blocks("Q5_1", 40, 3, rng).pack().reshape(2, 3, 7, 128), 40, isa=isa)
    with pytest.raises(RuntimeError, match="x has 64 columns, the weight 96"):
        cpu_kernels.gguf_linear(x[:, :64].contiguous(), packed, 40, isa=isa)
    with pytest.raises(RuntimeError, match="n = 90 does not match the weight's 2 panels"):
        cpu_kernels.gguf_linear(x, packed, 90, isa=isa)
    if isa == "avx2":
        with pytest.raises(RuntimeError, match="vnni is in the avx512 build only"):
            cpu_kernels.gguf_linear(x, packed, 40, vnni=True, isa=isa)


def test_int8_activations_follow_their_switch(monkeypatch):
    """The 4-bit forms pack for int8 activations (4-d records of the same bytes a block) unless
    CHARIOTEER_GGUF_INT8_ACTIVATIONS=0, which the GGUF kernels' choice shows (Kernels.gguf_int8_activations); the
    other forms keep their records; a value other than 0 or 1 is refused."""
    from charioteer.model.config import ModelConfig
    from charioteer.model.llama import Kernels

    config = ModelConfig(name="t", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1,
                         num_kv_heads=1)
    rng = np.random.default_rng(3)
    q41, q80 = _random_blocks("Q4_1", 32, 2, rng), _random_blocks("Q8_0", 32, 2, rng)
    monkeypatch.setenv("CHARIOTEER_GGUF_INT8_ACTIVATIONS", "0")
    assert not int8_activation_records() and q41.pack().dim() == 3
    assert not Kernels.choose(config, torch.device("cpu"), gguf=True).gguf_int8_activations
    monkeypatch.delenv("CHARIOTEER_GGUF_INT8_ACTIVATIONS")  # on by default
    assert int8_activation_records() and q41.pack().shape == (1, 2, 5, 128)
    assert Kernels.choose(config, torch.device("cpu"), gguf=True).gguf_int8_activations == (GGUF_KERNEL is None)
    assert not Kernels.choose(config, torch.device("cpu")).gguf_int8_activations  # GGUF blocks only
    assert torch.equal(GGUFLinear(q41, int8_activations=True).panels, q41.pack())
    assert torch.equal(q80.pack(), q80.pack(int8_activations=False))
    monkeypatch.setenv("CHARIOTEER_GGUF_INT8_ACTIVATIONS", "yes")
    with pytest.raises(ValueError, match="CHARIOTEER_GGUF_INT8_ACTIVATIONS=yes is neither 0 nor 1"):
        q41.pack()


def test_gguf_needs_a_gguf_file():
    kinds = ("Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, Q2_K, IQ1_S, IQ1_M, IQ2_XXS, "
             "IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S")
    with pytest.raises(ValueError, match=f"runs a GGUF file's own {kinds} blocks"):
        LLM("synthetic:tiny", quantization="gguf")


@pytest.mark.parametrize("kernel", ["on", "off"])
def test_gguf_runs_the_files_blocks_or_else_their_fp32_weights(default_model, kernel, monkeypatch):
    """With the kernel every linear layer and the LM head run the file's blocks, a step reading 0.63 bytes a
    weight; with CHARIOTEER_GGUF_KERNEL=0 (or no CPU kernels) they run as fp32 does, on the same weights
    dequantized, and give fp32's tokens."""
    monkeypatch.setenv("CHARIOTEER_GGUF_KERNEL", "1" if kernel == "on" else "0")
    monkeypatch.setenv("CHARIOTEER_GGUF_INT8_ACTIVATIONS", "0")  # tokens against fp32's: _assert_agrees_with_fp32
    llm = LLM(default_model, quantization="gguf", enable_prefix_caching=False)
    model = llm.engine.model
    runs = cpu_kernels.gguf_unavailable_reason() is None  # read after the switch is set
    assert model.kernels.gguf == runs
    assert all(isinstance(lin, GGUFLinear if runs else Linear) for layer in model.linears for lin in layer.values())
    assert isinstance(model.lm_head_linear, GGUFLinear if runs else Linear)
    fp32 = LLM(default_model, enable_prefix_caching=False)
    if runs:
        assert model.streamed_weight_bytes < 0.2 * fp32.engine.model.streamed_weight_bytes
    _assert_agrees_with_fp32(llm, fp32, exact=not runs)


def _assert_agrees_with_fp32(llm: LLM, fp32: LLM, exact: bool = False) -> None:
    """Greedy tokens of `llm` on two short prompts: fp32's (`exact`), or at least 3/4 of them position by position.
    For int16 activations: with int8 ones one early near-tie on a prompt takes half its tokens, so their tokens
    are held to a floor over 24 chats instead (tests/test_precision.py)."""
    assert not llm.engine.model.kernels.gguf_int8_activations
    prompts = [fp32.tokenizer.encode("The tallest mountain on Earth is"), fp32.tokenizer.encode("1, 2, 3, 4,")]
    params = SamplingParams(temperature=0, max_tokens=12)
    ours, reference = ([o.outputs[0].token_ids for o in x.generate(prompts, params)] for x in (llm, fp32))
    if exact:
        assert ours == reference
    else:
        assert sum(a == b for x, y in zip(ours, reference) for a, b in zip(x, y)) >= 0.75 * sum(map(len, reference))


def _on_min_and_range(sub: np.ndarray, levels: int, grid_top: int, rounding=np.round) -> tuple:
    """Sub-blocks [rows, blocks, subs, n] as the K kinds with a min (Q4_K, Q5_K, Q2_K) hold them: each one's range /
    `levels` and -min (the min at most 0) on 0..`grid_top` grids of its super-block's fp16 d and dmin (`rounding`
    them), and its q (0..levels) by a plain rounding. Returns d, dmin, sc, mn and q."""
    low = np.minimum(sub.min(-1), 0)
    step, mins = (sub.max(-1) - low) / levels, -low
    d, dmin = (step.max(-1) / grid_top).astype(np.float16), (mins.max(-1) / grid_top).astype(np.float16)

    def grid(v, unit):  # v / unit on 0..grid_top, 0 where the unit is
        unit = unit.astype(np.float32)[..., None]
        on_grid = rounding(np.divide(v, unit, out=np.zeros_like(v), where=unit > 0))
        return np.clip(on_grid, 0, grid_top).astype(np.uint8)

    sc, mn = grid(step, d), grid(mins, dmin)
    scale = (d.astype(np.float32)[..., None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[..., None] * mn)[..., None]
    q = np.round(np.divide(sub + offset, scale, out=np.zeros_like(sub), where=scale > 0))
    return d, dmin, sc, mn, np.clip(q, 0, levels).astype(np.uint8)


def _q4_k_bytes(w: np.ndarray, fifth_bit: bool = False) -> np.ndarray:
    """w [rows, cols] (cols a multiple of 256) in Q4_K blocks (Q5_K with `fifth_bit`), by a plain rounding (not
    llama.cpp's search): each sub-block's range and min on the 6-bit grids of its super-block's d and dmin.
    gguf-py has no K-quant quantizer."""
    rows, top = w.shape[0], 31 if fifth_bit else 15
    d, dmin, sc, mn, q = _on_min_and_range(w.reshape(rows, -1, 8, 32).astype(np.float32), top, 63)
    packed = np.concatenate([(sc[..., :4] & 63) | (sc[..., 4:] >> 4 << 6), (mn[..., :4] & 63) | (mn[..., 4:] >> 4 << 6),
                             (sc[..., 4:] & 15) | (mn[..., 4:] << 4)], axis=-1)
    nibbles = (q & 15).reshape(rows, -1, 4, 2, 32)  # sub-blocks 2g and 2g + 1 in the low and high nibbles of 32 bytes
    qs = (nibbles[..., 0, :] | nibbles[..., 1, :] << 4).reshape(rows, -1, 128)
    head = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed], axis=-1)
    if fifth_bit:  # bit g of byte j: value 32g + j's
        head = np.concatenate([head, (q >> 4 << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)], -1)
    return np.concatenate([head, qs], axis=-1).reshape(rows, -1)


def _iq4_nl_bytes(w: np.ndarray) -> np.ndarray:
    """w [rows, cols] in IQ4_NL blocks: d the block's largest |w| / 127, each value the nearest d * IQ4_VALUES."""
    rows = w.shape[0]
    block = w.reshape(rows, -1, 32).astype(np.float32)
    d = (np.abs(block).max(-1) / 127).astype(np.float16)
    grid = d.astype(np.float32)[..., None, None] * IQ4_VALUES.astype(np.float32)
    q = np.abs(block[..., None] - grid).argmin(-1).astype(np.uint8)  # [rows, blocks, 32]
    return np.concatenate([d[..., None].view(np.uint8), q[..., :16] | q[..., 16:] << 4], axis=-1).reshape(rows, -1)


def _q6_k_bytes(w: np.ndarray) -> np.ndarray:
    """w [rows, cols] (cols a multiple of 256) in Q6_K blocks, by a plain rounding: each 16 values' largest |w| / 31
    on the int8 grid of its super-block's d (the largest of them / 127)."""
    rows = w.shape[0]
    sub = w.reshape(rows, -1, 16, 16).astype(np.float32)
    step = np.abs(sub).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16)
    unit = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(step, unit, out=np.zeros_like(step), where=unit > 0)), -128, 127).astype(np.int8)
    scale = (unit * sc)[..., None]
    q = np.clip(np.round(np.divide(sub, scale, out=np.zeros_like(sub), where=scale > 0)) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(rows, -1, 2, 2, 64)  # per half of 128: values 0-63 and 64-127
    low = (q[..., 0, :] & 15) | (q[..., 1, :] & 15) << 4  # [rows, blocks, 2 halves, 64]
    high = (q >> 4).reshape(rows, -1, 2, 4, 32)  # bit pairs of values 32 apart
    high = high[..., 0, :] | high[..., 1, :] << 2 | high[..., 2, :] << 4 | high[..., 3, :] << 6
    return np.concatenate([low.reshape(rows, -1, 128), high.reshape(rows, -1, 64), sc.view(np.uint8),
                           d[..., None].view(np.uint8)], axis=-1).reshape(rows, -1)


def _q2_k_bytes(w: np.ndarray) -> np.ndarray:
    """w [rows, cols] (cols a multiple of 256) in Q2_K blocks, by a plain rounding: each 16 values' range / 3 and
    min on the 4-bit grids of its super-block's d and dmin."""
    rows = w.shape[0]
    # scales rounded up: a step never too small for its range
    d, dmin, sc, mn, q = _on_min_and_range(w.reshape(rows, -1, 16, 16).astype(np.float32), 3, 15, np.ceil)
    q = q.reshape(rows, -1, 2, 4, 32)  # value 128h + 32j + l: byte 32h + l, bit pair j
    qs = (q[..., 0, :] | q[..., 1, :] << 2 | q[..., 2, :] << 4 | q[..., 3, :] << 6).reshape(rows, -1, 64)
    return np.concatenate([sc | mn << 4, qs, d[..., None].view(np.uint8), dmin[..., None].view(np.uint8)],
                          axis=-1).reshape(rows, -1)


def _quantized(w: torch.Tensor, kind: str) -> GGUFWeight:
    """gguf-py's quantizer, or for the K-quants and IQ4_NL (it has none) a plain one here."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    ours = {"Q4_K": _q4_k_bytes, "Q5_K": lambda w: _q4_k_bytes(w, fifth_bit=True), "Q6_K": _q6_k_bytes,
            "IQ4_NL": _iq4_nl_bytes, "Q2_K": _q2_k_bytes}
    data = ours[kind](w.numpy()) if kind in ours else quantize(w.numpy(), GGMLQuantizationType[kind])
    return GGUFWeight(kind, torch.from_numpy(np.ascontiguousarray(data)))


@pytest.mark.parametrize("kind, within", [("Q4_K", 0.25), ("Q5_K", 0.25), ("Q6_K", 0.25), ("IQ4_NL", 0.25),
                                          ("Q2_K", 0.5)])  # 2 bits: half a step of a third of the range
def test_the_test_quantizers_are_close(kind, within):
    w = torch.from_numpy(np.random.default_rng(5).standard_normal((4, 512)).astype(np.float32))
    assert (_quantized(w, kind).dequantize() - w).abs().max() < within * w.abs().max()


# As llama.cpp's Q4_K_M of SmolLM2 (whose 576 columns take no K-quant): Q5_0, with V in Q8_0; down projections
# (1536 columns) in Q4_K in even layers and Q6_K in odd ones, but layer 1's in none (as a kind that runs in
# fp32); a Q4_0 LM head. Its Q5_K_M and IQ4_XS: mostly Q5_1 and IQ4_NL, with Q5_K downs.
Q4_K_M_KINDS = {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q4_0", "gate_proj": "Q5_0",
                "up_proj": "Q5_0", "down_proj": "Q4_K", "embed_tokens": "Q4_0"}
Q5_K_M_KINDS = {"q_proj": "Q5_1", "k_proj": "Q5_1", "v_proj": "Q8_0", "o_proj": "IQ4_NL", "gate_proj": "Q5_1",
                "up_proj": "Q4_0", "down_proj": "Q5_K", "embed_tokens": "IQ4_NL"}
# A Q2_K file: Q4_0 where the columns take no K-quant (576), the down projections in Q2_K (and Q6_K in odd layers)
Q2_K_KINDS = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q4_0", "o_proj": "Q4_0", "gate_proj": "Q4_0",
              "up_proj": "Q4_0", "down_proj": "Q2_K", "embed_tokens": "Q4_0"}


def _mixed_kind(kinds: dict[str, str], name: str) -> str | None:
    kind = next((k for part, k in kinds.items() if f".{part}." in name), None)
    if kind != kinds["down_proj"] or int(name.split(".")[2]) % 2 == 0:
        return kind
    return None if name.startswith("model.layers.1.") else "Q6_K"


@needs_kernel
@pytest.mark.parametrize("kinds, records", [
    (Q4_K_M_KINDS, {1088, 768, 1280}),  # int8 q; nibbles with fp32 scales; int8 q with a d per 16 (+ Q5_0's 704)
    (Q5_K_M_KINDS, {1536, 1088, 896, 1280}),  # QKV mixed; IQ4_NL as int8; 5-bit q with fp32 d, m; Q6_K
    (Q2_K_KINDS, {768, 1536, 1280}),  # Q4_0 as 4-bit q with fp32 d, m; Q2_K mixed; Q6_K
], ids=["q4_k_m", "q5_k_m", "q2_k"])
def test_a_file_of_mixed_kinds_runs_every_linear_on_its_blocks(default_model, kinds, records, monkeypatch):
    """Fused weights of parts in one kernel form or none (a Q5_1 Q and K beside a Q8_0 V: the mixed records), and
    the K kinds: every linear layer with blocks and the LM head run them, the others fp32's panels, in the one-call
    decode too (with VNNI where the CPU has it); the 4-bit forms in their int8-activation records by default.
    With int16 activations (CHARIOTEER_GGUF_INT8_ACTIVATIONS=0) greedy tokens are mostly fp32's on the same
    (dequantized) weights; int8 activations' tokens are held to their own floor on the real file
    (tests/test_precision.py): on two prompts of a Q2_K file one early near-tie takes half the tokens."""
    blocks, state = {}, dict(default_model.state_dict)
    for name, w in default_model.state_dict.items():
        kind = _mixed_kind(kinds, name)
        if kind is not None:
            blocks[name] = _quantized(w, kind)
            state[name] = blocks[name].dequantize()
    loaded = dataclasses.replace(default_model, state_dict=state, gguf_blocks=blocks)
    five = {704} if five_bit_records() and kinds is Q4_K_M_KINDS else set()  # the Q5_0 gate/up
    for int8_x in (True, False):
        monkeypatch.setenv("CHARIOTEER_GGUF_INT8_ACTIVATIONS", "1" if int8_x else "0")
        llm = LLM(loaded, quantization="gguf", enable_prefix_caching=False)
        model = llm.engine.model
        assert all(isinstance(lin, Linear if (i, name) == (1, "down") else GGUFLinear)
                   for i, layer in enumerate(model.linears) for name, lin in layer.items())
        assert isinstance(model.lm_head_linear, GGUFLinear) and model.decode_layers is not None
        panels = [lin.panels for layer in model.linears for lin in layer.values() if isinstance(lin, GGUFLinear)]
        assert all(p.dim() == (4 if int8_x else 3) for p in panels if p.shape[-1] in (128, 640, 768))  # 4-bit
        assert {p.shape[-1] if p.dim() == 3 else p.shape[-2] * p.shape[-1] for p in panels} == records | five
    _assert_agrees_with_fp32(llm, LLM(loaded, enable_prefix_caching=False))


@needs_kernel
def test_lattice_kinds_run_in_the_model_on_their_blocks(default_model, monkeypatch):
    """IQ1-IQ3 down projections (random codebook entries at a small scale: there is no quantizer for them here)
    run on their blocks as int8 q with a scale per 16 values, in the one-call decode too, with greedy tokens
    mostly those of fp32 on the same weights (int16 activations in the other, Q4_1, layers)."""
    monkeypatch.setenv("CHARIOTEER_GGUF_INT8_ACTIVATIONS", "0")  # tokens against fp32's: _assert_agrees_with_fp32
    rng = np.random.default_rng(7)
    blocks, state = {}, dict(default_model.state_dict)
    for layer, kind in enumerate(["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]):
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        rows, cols = state[name].shape
        blocks[name] = _random_blocks(kind, rows, cols // 256, rng, scale=2e-4)  # values about a tenth of the weights
        state[name] = blocks[name].dequantize()
    loaded = dataclasses.replace(default_model, state_dict=state, gguf_blocks=blocks)
    llm = LLM(loaded, quantization="gguf", enable_prefix_caching=False)
    model = llm.engine.model
    downs = [layer["down"] for layer in model.linears]
    assert all(isinstance(lin, GGUFLinear) and lin.panels.shape[-1] == 1280 for lin in downs[:7])
    assert model.decode_layers is not None
    _assert_agrees_with_fp32(llm, LLM(loaded, enable_prefix_caching=False))


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
@pytest.mark.parametrize("int8_activations", ["0", "1"])
def test_gguf_pipeline_stages_get_their_blocks_and_agree_with_one_process(default_model, int8_activations,
                                                                          monkeypatch):
    """Each stage process receives its layers' blocks (and the last the LM head's) with its state dict, and
    packs them as the driver's switch says (CHARIOTEER_GGUF_INT8_ACTIVATIONS, read in each process)."""
    monkeypatch.setenv("CHARIOTEER_GGUF_INT8_ACTIVATIONS", int8_activations)
    prompts = [[(7 * i + 3 * j) % 5000 + 100 for j in range(n)] for i, n in enumerate([9, 40, 4, 23])]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    one = LLM(default_model, quantization="gguf", chunk_size=16, enable_prefix_caching=False)
    assert one.engine.model.kernels.gguf_int8_activations == (int8_activations == "1")
    reference = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in one.generate(prompts, params)]
    piped = LLM(default_model, quantization="gguf", chunk_size=16, enable_prefix_caching=False,
                pipeline_parallel_size=2)
    try:
        outputs = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in piped.generate(prompts, params)]
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
