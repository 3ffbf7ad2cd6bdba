"""The CPU kernels (charioteer/model/kernels/), each build this CPU can execute (AVX-512, AVX2):
against float64 and torch's ops, the panel GEMM's batch invariance, and the model's outputs."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from charioteer.model import cpu_kernels
from charioteer.model.llama import NARROW_PANEL_ROWS_FACTOR, Int8Linear, Linear
from charioteer.model.precision import quantize_int8

# Every build, skipped (with the reason) where this CPU cannot execute it or it does not build.
each_isa = pytest.mark.parametrize("isa", [
    pytest.param(isa, marks=pytest.mark.skipif(cpu_kernels.load_reason(isa) is not None,
                                               reason=f"{isa} kernels: {cpu_kernels.load_reason(isa)}"))
    for isa in cpu_kernels.ISAS])


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@each_isa
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 100), k=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_matches_float64(rows, n, k, seed, isa):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    y = cpu_kernels.linear(x, cpu_kernels.pack(w, isa=isa), n, isa=isa)
    assert y.shape == (rows, n)
    torch.testing.assert_close(y, _reference(x, w), rtol=1e-4, atol=1e-4 * k**0.5)


@each_isa
def test_rows_do_not_depend_on_the_batch(isa):
    """Sums run over k in order per output, so a row's bits are the same alone, shuffled or in any batch."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 1536, generator=g)  # K spans several 128-wide slices
    x = torch.randn(32, 1536, generator=g)
    panels = cpu_kernels.pack(w, isa=isa)
    full = cpu_kernels.linear(x, panels, 200, isa=isa)
    perm = torch.randperm(32, generator=g)
    assert torch.equal(cpu_kernels.linear(x[perm], panels, 200, isa=isa), full[perm])
    for i in (0, 7, 8, 31):
        assert torch.equal(cpu_kernels.linear(x[i:i + 1], panels, 200, isa=isa)[0], full[i])
    assert torch.equal(cpu_kernels.linear(x[3:20], panels, 200, isa=isa), full[3:20])


@each_isa
def test_non_contiguous_input_and_empty_batch(isa):
    w, x = torch.randn(40, 64), torch.randn(64, 6)
    panels = cpu_kernels.pack(w, isa=isa)
    torch.testing.assert_close(cpu_kernels.linear(x.T, panels, 40, isa=isa), _reference(x.T, w))
    wide = torch.randn(11, 100)  # rows read in place at their stride: the same bits as a copy
    strided, copied = wide[:, 3:67], wide[:, 3:67].contiguous()
    assert torch.equal(cpu_kernels.linear(strided, panels, 40, isa=isa), cpu_kernels.linear(copied, panels, 40, isa=isa))
    assert cpu_kernels.linear(torch.empty(0, 64), panels, 40, isa=isa).shape == (0, 40)


@each_isa
def test_bad_shapes_are_refused(isa):
    panels = cpu_kernels.pack(torch.randn(40, 64), isa=isa)
    with pytest.raises(RuntimeError, match="x has 63 columns, the weight 64"):
        cpu_kernels.linear(torch.randn(2, 63), panels, 40, isa=isa)
    with pytest.raises(RuntimeError, match="n out of range"):
        cpu_kernels.linear(torch.randn(2, 64), panels, 65, isa=isa)


@each_isa
def test_kernels_write_into_a_given_out_and_refuse_a_wrong_one(isa):
    """The one-call decode layers keep each output from one layer to the next (`out`): the same bits as a new
    tensor, and an out of another shape or dtype, or sharing memory with an input, is refused by name."""
    kernels, g = cpu_kernels._kernels(isa), torch.Generator().manual_seed(0)
    x, w, gate_up = torch.randn(3, 64, generator=g), torch.randn(40, 64, generator=g), torch.randn(3, 80, generator=g)
    panels = cpu_kernels.pack(w, isa=isa)
    out, act = torch.empty(3, 40), torch.empty(3, 40)
    assert kernels.panel_linear(x, panels, 40, out=out).data_ptr() == out.data_ptr()
    assert kernels.silu_mul(gate_up, out=act).data_ptr() == act.data_ptr()
    assert torch.equal(out, kernels.panel_linear(x, panels, 40)) and torch.equal(act, kernels.silu_mul(gate_up))
    with pytest.raises(RuntimeError, match=r"panel_linear: out must be a contiguous float CPU tensor of shape \[3, 40\]"):
        kernels.panel_linear(x, panels, 40, out=torch.empty(3, 41))
    with pytest.raises(RuntimeError, match="silu_mul: out must be a contiguous float"):
        kernels.silu_mul(gate_up, out=act.bfloat16())
    with pytest.raises(RuntimeError, match="rope: out must be a contiguous"):
        kernels.rope(torch.randn(3, 2, 64), torch.randn(3, 64), torch.randn(3, 64), out=torch.empty(6, 64))
    both = torch.randn(6, 64, generator=g)  # x in its first rows: out below it, then over it
    norm = torch.rand(64, generator=g)
    kernels.rms_norm(both[:3], norm, 1e-5, out=both[3:])
    with pytest.raises(RuntimeError, match="rms_norm: out must not share memory with an input"):
        kernels.rms_norm(both[:3], norm, 1e-5, out=both[2:5])
    with pytest.raises(RuntimeError, match="add_rms_norm_: out must not share memory with an input"):
        kernels.add_rms_norm_(x, both[:3], norm, 1e-5, False, out=both[:3])
    with pytest.raises(RuntimeError, match="silu_mul: out must not share memory with an input"):
        kernels.silu_mul(gate_up[:1], out=gate_up[0, 40:].view(1, 40))


# the one-call decode layers exist only in the kernels' builds (CHARIOTEER_CPU_KERNELS=off has none)
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def _small_decode_layers(g, heads, kv_heads, hidden=64, dim=64, inter=96, layers=2):
    """A DecodeLayers of `layers` layers on random fp32 panels, and its norm weights (one per layer)."""
    def packed(n, k):
        return [cpu_kernels.pack(torch.randn(n, k, generator=g) * 0.1) for _ in range(layers)]

    norms = [torch.rand(hidden, generator=g) + 0.5 for _ in range(layers)]
    runner = cpu_kernels.decode_layers(norms, packed((heads + 2 * kv_heads) * dim, hidden), packed(hidden, heads * dim),
                                       norms, packed(2 * inter, hidden), packed(hidden, inter), heads=heads,
                                       kv_heads=kv_heads, head_dim=dim, intermediate=inter, eps=1e-5, scale=dim ** -0.5)
    return runner, norms


@needs_kernels
def test_one_region_decode_layers_are_bitwise_one_region_per_op_and_release_threads_on_a_bad_slot():
    """A small batch's layers run in one parallel region, the threads meeting between ops: the bits of one
    thread's run, and an error on one thread (a KV slot out of range, met by the row ops' thread alone) ends
    the call for every thread instead of leaving them waiting."""
    hidden, kv_heads, dim, layers, g = 64, 1, 64, 2, torch.Generator().manual_seed(0)
    runner, norms = _small_decode_layers(g, heads=2, kv_heads=kv_heads)
    x = torch.randn(2, hidden, generator=g)
    cos, sin = torch.rand(2, dim, generator=g), torch.rand(2, dim, generator=g)
    slots, lengths = torch.tensor([[0, 1, 2], [3, 4, 0]]), torch.tensor([3, 2])

    def run(slot_mapping, threads):
        kv, y, before = torch.zeros(layers, 2, 9, kv_heads, dim), x.clone(), torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return runner.run(y, cpu_kernels.rms_norm(x, norms[0], 1e-5), kv, cos, sin, slot_mapping, slots, lengths), kv
        finally:
            torch.set_num_threads(before)

    with pytest.raises(RuntimeError, match="slot out of range"):
        run(torch.tensor([2, 9]), 2)
    (team, team_kv), (alone, alone_kv) = run(torch.tensor([2, 4]), 2), run(torch.tensor([2, 4]), 1)
    assert torch.equal(team, alone) and torch.equal(team_kv, alone_kv) and not torch.equal(team, x)


def _assert_team_is_one_thread(runner, norm, rows, width, cache, g, dtype):
    """`rows` decodes with contexts of 1 to `width` positions in random slots of a [layers, 2, slots, kv_heads, dim]
    cache (`cache`: layers, kv_heads, dim) of `dtype`, the first norm in `dtype` too: the team's (2 threads) output
    and cache are one thread's bit for bit."""
    layers, kv_heads, dim = cache
    hidden = norm.numel()
    kv0 = torch.randn(layers, 2, rows * width + 1, kv_heads, dim, generator=g).to(dtype)
    x = torch.randn(rows, hidden, generator=g)
    cos, sin = torch.rand(rows, dim, generator=g), torch.rand(rows, dim, generator=g)
    slots = torch.randperm(rows * width, generator=g).view(rows, width)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)

    def run(threads):
        kv, y, before = kv0.clone(), x.clone(), torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            h = cpu_kernels.rms_norm(x, norm, 1e-5).to(dtype)
            mapping = slots[torch.arange(rows), lengths - 1]
            return runner.run(y, h, kv, cos, sin, mapping, slots, lengths), kv
        finally:
            torch.set_num_threads(before)

    (team, team_kv), (alone, alone_kv) = run(2), run(1)
    assert torch.equal(team, alone) and torch.equal(team_kv, alone_kv) and not torch.equal(team, x)


@needs_kernels
@pytest.mark.parametrize("rows", [16, 17])
def test_a_batch_of_up_to_16_decodes_runs_in_one_region_with_one_threads_bits(rows):
    """The team takes batches of up to 16 rows (17 run a region per op): with contexts of different lengths,
    each thread's share of the panels, rows and attention gives the bits of one thread's run."""
    g = torch.Generator().manual_seed(3)
    runner, norms = _small_decode_layers(g, heads=2, kv_heads=1)  # 2 layers of head size 64
    _assert_team_is_one_thread(runner, norms[0], rows, 40, (2, 1, 64), g, torch.float32)


@pytest.mark.parametrize("kernel", ["amx", "avx512_bf16"])
def test_bf16_decode_layers_on_a_tile_kernel_run_16_rows_in_one_region_with_one_threads_bits(kernel):
    """bf16 weights in amx_pack's order, the batches below native_rows on AMX tiles or AVX512-BF16: inside the
    team each thread computes its share of the column pairs (amx_linear_into, avx512_bf16_linear_into), and 16
    decodes give the bits of one thread's run."""
    if kernel == "amx" and not cpu_kernels.amx_available():
        pytest.skip(f"AMX tiles: {cpu_kernels.amx_unavailable_reason()}")
    if kernel == "avx512_bf16" and cpu_kernels.avx512_bf16_unavailable_reason() is not None:
        pytest.skip(f"AVX512-BF16: {cpu_kernels.avx512_bf16_unavailable_reason()}")
    rows, hidden, heads, kv_heads, dim, inter, layers = 16, 64, 2, 1, 64, 96, 2
    g = torch.Generator().manual_seed(4)

    def weights(n, k):
        return [(torch.randn(n, k, generator=g) * 0.1).bfloat16() for _ in range(layers)]

    qkv, o, gate_up, down = (weights((heads + 2 * kv_heads) * dim, hidden), weights(hidden, heads * dim),
                             weights(2 * inter, hidden), weights(hidden, inter))
    norms = [torch.rand(hidden, generator=g) + 0.5 for _ in range(layers)]
    packed = [[cpu_kernels.amx_pack(w) for w in ws] for ws in (qkv, o, gate_up, down)]
    runner = cpu_kernels.decode_layers(norms, *packed[:2], norms, *packed[2:], heads=heads, kv_heads=kv_heads,
                                       head_dim=dim, intermediate=inter, eps=1e-5, scale=dim ** -0.5,
                                       plain_weights=[w for i in range(layers) for w in (qkv[i], o[i], gate_up[i],
                                                                                         down[i])],
                                       native_rows=rows + 1, amx_tiles=kernel == "amx")
    _assert_team_is_one_thread(runner, norms[0], rows, 30, (layers, kv_heads, dim), g, torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("heads, chunks", [(6, 2), (9, 0)])
def test_one_region_decode_layers_spread_a_long_context_over_the_threads(heads, chunks):
    """A context of several attention chunks is split over the team's threads by positions, its chunks combined
    after the threads meet; a context of one chunk with three query heads to a KV head has a KV head's heads
    split between the threads: the bits of one thread's run, with a short context beside it or alone."""
    hidden, kv_heads, dim, layers, g = 64, 3, 64, 2, torch.Generator().manual_seed(2)
    chunk = cpu_kernels.decode_attention_chunk()
    runner, norms = _small_decode_layers(g, heads=heads, kv_heads=kv_heads)
    long = chunks * chunk + 37
    width = long + 3
    kv0 = torch.randn(layers, 2, 2 * width + 1, kv_heads, dim, generator=g)
    x = torch.randn(2, hidden, generator=g)
    cos, sin = torch.rand(2, dim, generator=g), torch.rand(2, dim, generator=g)
    slots = torch.randperm(2 * width, generator=g).view(2, width)
    lengths = torch.tensor([long, 5])

    def run(rows, threads):
        kv, y, before = kv0.clone(), x[rows].clone(), torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            h = cpu_kernels.rms_norm(x[rows], norms[0], 1e-5)
            mapping = slots[rows, lengths[rows] - 1]
            return runner.run(y, h, kv, cos[rows], sin[rows], mapping, slots[rows], lengths[rows])
        finally:
            torch.set_num_threads(before)

    both, first = [0, 1], [0]
    assert torch.equal(run(both, 2), run(both, 1))
    assert torch.equal(run(first, 2), run(first, 1)) and torch.equal(run(first, 2)[0], run(both, 2)[0])


@needs_kernels
def test_decode_layers_run_tokens_is_the_embedding_norms_and_run_and_refuses_rows_past_its_tables():
    """run_tokens: the embedding's rows (a bf16 table widened), the RoPE tables' rows, the first norm, run and the
    final norm in one call, bit for bit those ops one by one; a token or position past its table is refused."""
    hidden, kv_heads, dim, layers, g = 64, 1, 64, 2, torch.Generator().manual_seed(1)
    runner, norms = _small_decode_layers(g, heads=2, kv_heads=kv_heads)
    norms = norms + [torch.rand(hidden, generator=g) + 0.5]  # the last: the final norm
    cos, sin = torch.rand(16, dim, generator=g), torch.rand(16, dim, generator=g)
    tokens, positions = torch.tensor([7, 3]), torch.tensor([2, 1])
    slots, lengths, slot_mapping = torch.tensor([[0, 1, 2], [3, 4, 0]]), torch.tensor([3, 2]), torch.tensor([2, 4])
    for embed in (torch.randn(10, hidden, generator=g), torch.randn(10, hidden, generator=g).bfloat16()):
        one_kv, each_kv = torch.zeros(layers, 2, 9, kv_heads, dim), torch.zeros(layers, 2, 9, kv_heads, dim)
        one = runner.run_tokens(tokens, positions, embed, cos, sin, norms[-1], one_kv, slot_mapping, slots, lengths)
        x = embed[tokens].float()
        x = runner.run(x, cpu_kernels.rms_norm(x, norms[0], 1e-5), each_kv, cos[positions], sin[positions],
                       slot_mapping, slots, lengths)
        assert torch.equal(one, cpu_kernels.rms_norm(x, norms[-1], 1e-5)) and torch.equal(one_kv, each_kv)
    kv = torch.zeros(layers, 2, 9, kv_heads, dim)
    with pytest.raises(RuntimeError, match=r"embed row 10 is out of range \[0, 10\)"):
        runner.run_tokens(torch.tensor([7, 10]), positions, embed, cos, sin, norms[-1], kv, slot_mapping, slots,
                          lengths)
    with pytest.raises(RuntimeError, match=r"cos row 16 is out of range"):
        runner.run_tokens(tokens, torch.tensor([2, 16]), embed, cos, sin, norms[-1], kv, slot_mapping, slots, lengths)


def _narrow_weight(kind: str, n: int, k: int, g: torch.Generator):
    """(the weight as packed, its scale or None, the fp32 weight it stands for) of a bf16 or int8 weight."""
    w = torch.randn(n, k, generator=g)
    if kind == "bf16":
        return w.bfloat16(), None, w.bfloat16().float()
    q, scale = quantize_int8(w)
    return q, scale, q.float() * scale[:, None]


@each_isa
@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["bf16", "int8"]), rows=st.integers(1, 40), n=st.integers(1, 100), k=st.integers(1, 300),
       seed=st.integers(0, 2**31 - 1))
def test_narrow_weights_match_their_float64_product(kind, rows, n, k, seed, isa):
    """bf16 and int8 weights widened in the kernel: one row block widens as it streams, several
    share a widened copy of each slice; both give the product with the weight they stand for."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    stored, scale, w = _narrow_weight(kind, n, k, g)
    y = cpu_kernels.linear(x, cpu_kernels.pack(stored, isa=isa), n, scale, isa=isa)
    torch.testing.assert_close(y, _reference(x, w), rtol=1e-4, atol=1e-4 * k**0.5 * float(w.abs().max()))


@each_isa
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_narrow_weights_rows_do_not_depend_on_the_batch(kind, isa):
    g = torch.Generator().manual_seed(1)
    stored, scale, _ = _narrow_weight(kind, 200, 1536, g)
    x = torch.randn(32, 1536, generator=g)
    panels = cpu_kernels.pack(stored, isa=isa)
    full = cpu_kernels.linear(x, panels, 200, scale, isa=isa)  # several row blocks: the widened copy
    for i in (0, 7, 31):  # one row: widened as it streams
        assert torch.equal(cpu_kernels.linear(x[i:i + 1], panels, 200, scale, isa=isa)[0], full[i])
    assert torch.equal(cpu_kernels.linear(x[3:20], panels, 200, scale, isa=isa), full[3:20])


@each_isa
def test_int8_panels_need_their_scales(isa):
    q, scale = quantize_int8(torch.randn(40, 64))
    panels = cpu_kernels.pack(q, isa=isa)
    with pytest.raises(RuntimeError, match="int8 panels take one fp32 scale per output column"):
        cpu_kernels.linear(torch.randn(2, 64), panels, 40, isa=isa)
    with pytest.raises(RuntimeError, match="scale must be a contiguous fp32 vector"):
        cpu_kernels.linear(torch.randn(2, 64), panels, 40, scale[:39], isa=isa)
    with pytest.raises(RuntimeError, match="int8 panels take one fp32 scale"):
        cpu_kernels.linear(torch.randn(2, 64), cpu_kernels.pack(torch.randn(40, 64), isa=isa), 40, scale, isa=isa)


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")
def test_linear_routes_by_rows():
    """Up to cpu_kernels.max_rows() rows run on the chosen build's panel kernel; more go to MKL's kernels."""
    w = torch.randn(96, 128)
    lin = Linear(w, pack=False, panel_rows=cpu_kernels.max_rows())
    small = torch.randn(cpu_kernels.max_rows(), 128)
    assert torch.equal(lin(small), cpu_kernels.linear(small, lin.panels, 96))
    large = torch.randn(cpu_kernels.max_rows() + 1, 128)
    assert torch.equal(lin(large), torch.nn.functional.linear(large, w))


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")
def test_int8_linear_routes_by_rows():
    """int8 weights run on the panel kernel up to NARROW_PANEL_ROWS_FACTOR times its fp32 row limit,
    then dequantized through one fp32 GEMM; without the kernels, through torch's int8 GEMM."""
    w = torch.randn(96, 128)
    lin = Int8Linear(w, torch.float32, panel_rows=cpu_kernels.max_rows())
    exact = lin.weight.float() * lin.scale[:, None]
    limit = cpu_kernels.max_rows() * NARROW_PANEL_ROWS_FACTOR
    small = torch.randn(limit, 128)
    assert torch.equal(lin(small), cpu_kernels.linear(small, lin.panels, 96, lin.scale))
    large = torch.randn(limit + 1, 128)
    assert torch.equal(lin(large), torch.nn.functional.linear(large, exact))
    torch.testing.assert_close(lin(small), small @ exact.T, rtol=1e-4, atol=1e-4)
    portable = Int8Linear(w, torch.float32)
    assert portable.panels is None
    torch.testing.assert_close(portable(small), lin(small), rtol=1e-4, atol=1e-4)


def test_the_rows_the_cost_model_reads_are_where_the_linears_switch_paths():
    """LlamaModel.small_batch_rows and widen_rows (the simulator's step cost model takes them) against
    the routes its Linear and NarrowLinear take, on this CPU, for fp32, widened bf16 and int8."""
    from charioteer.model.config import ModelConfig
    from charioteer.model.llama import ONEDNN_PANEL_MAX_ROWS, PACKED_GEMM_MAX_ROWS, Kernels, NarrowLinear

    config = ModelConfig(name="t", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1,
                         num_kv_heads=1)
    fp32 = Kernels.choose(config, torch.device("cpu"))
    panel = cpu_kernels.max_rows()
    # beside oneDNN (a CPU not Intel's) the panel kernel takes fp32 up to ONEDNN_PANEL_MAX_ROWS
    assert fp32.panel_rows == (max(panel, ONEDNN_PANEL_MAX_ROWS if fp32.onednn_fp32 else 0) if panel else 0)
    assert fp32.widen_rows(quantized=False) == 0
    packed = PACKED_GEMM_MAX_ROWS if fp32.packed_gemm else 0
    assert fp32.small_batch_rows(quantized=False) == max(fp32.panel_rows, packed)
    for isa in cpu_kernels.ISAS:
        if cpu_kernels.cannot_run(isa) is None:
            block = cpu_kernels.row_block(isa)
            assert block in (4, 8) and cpu_kernels.PANEL_MAX_ROWS[isa] % block == 0
    if not cpu_kernels.available():
        return
    int8 = Kernels.choose(config, torch.device("cpu"), quantized=True)
    lin = Int8Linear(torch.randn(8, 64), torch.float32, panel, int8.int8_tile_rows, int8.int8_tile_kernel)
    # the panel kernel's rows, or, where int8 takes a tile kernel, the rows below it
    assert int8.small_batch_rows(quantized=True) == (lin.tile_rows - 1 if lin.tile_rows else lin.panel_rows)
    assert int8.widen_rows(quantized=True) == cpu_kernels.row_block() > 0
    assert NarrowLinear(torch.randn(8, 64).bfloat16(), None, panel).panel_rows == NARROW_PANEL_ROWS_FACTOR * panel


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")
@pytest.mark.parametrize("pack", ["1", "0"], ids=["onednn_packed", "plain"])
def test_widened_bf16_takes_torchs_bf16_gemm_from_its_native_rows(monkeypatch, pack):
    """Where the CPU computes bf16 (AMX), widened bf16 rounds the input of a batch of native_rows or
    more to bf16 for oneDNN's GEMM, on the weight packed for it unless CHARIOTEER_ONEDNN_PACK=0;
    fewer rows stay on the panel kernel. The cost model's small-batch rows end where the panel
    kernel does. Both paths round input and product to bf16."""
    from charioteer.model.llama import Kernels, NarrowLinear
    from charioteer.model.precision import onednn_packs_bf16

    monkeypatch.setenv("CHARIOTEER_ONEDNN_PACK", pack)
    w = torch.randn(96, 128).bfloat16()
    lin = NarrowLinear(w, None, panel_rows=cpu_kernels.max_rows(), native_rows=8)
    assert lin.weight.is_mkldnn == (pack == "1" and onednn_packs_bf16())
    small, large, larger = torch.randn(7, 128), torch.randn(8, 128), torch.randn(200, 128)
    rounded = small.bfloat16().float()
    assert torch.equal(lin(small), cpu_kernels.linear(rounded, lin.panels, 96).bfloat16().float())
    assert torch.equal(lin(large), torch.nn.functional.linear(large.bfloat16(), w).float())
    # oneDNN may block a larger GEMM's sums differently for a packed weight: one bf16 rounding apart
    reference = torch.nn.functional.linear(larger.bfloat16(), w).float()
    torch.testing.assert_close(lin(larger), reference, rtol=2 ** -7, atol=1e-6)
    with pytest.raises(ValueError, match="only bf16 weights without scales"):
        NarrowLinear(torch.ones(8, 64, dtype=torch.int8), torch.ones(8), cpu_kernels.max_rows(), native_rows=8)
    widened = Kernels(panel_rows=cpu_kernels.max_rows(), packed_gemm=False, row_ops=True, decode_attention=True,
                      decode_layers=True, widened_bf16=True, native_bf16_rows=8)
    assert widened.small_batch_rows(quantized=False) == 7
    with pytest.raises(ValueError, match="widened bf16 only"):
        Kernels(panel_rows=32, packed_gemm=False, row_ops=True, decode_attention=True, decode_layers=True,
                native_bf16_rows=8)


def _sdpa_reference(q, k_cache, v_cache, slots, lengths):
    """Per decode, float64 SDPA over its own context rows."""
    group = q.shape[1] // k_cache.shape[1]
    out = []
    for d in range(q.shape[0]):
        rows = slots[d, : lengths[d]]
        k = k_cache[rows].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, dim]
        v = v_cache[rows].double().repeat_interleave(group, dim=1).transpose(0, 1)
        out.append(torch.nn.functional.scaled_dot_product_attention(q[d].double()[:, None], k, v)[:, 0])
    return torch.stack(out).float()


@each_isa
@settings(max_examples=40, deadline=None)
@given(decodes=st.integers(1, 9), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 3, 4, 6, 8]),
       dim=st.sampled_from(cpu_kernels.HEAD_DIMS), width=st.one_of(st.integers(1, 70), st.integers(1000, 2600)),
       seed=st.integers(0, 2**31 - 1), cache_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_decode_attention_matches_float64(decodes, kv_heads, group, dim, width, seed, cache_dtype, isa):
    """A bf16 cache is widened exactly: its result is its widened values' (widened bf16, precision.py). Contexts
    past one chunk (decode_attention_chunk, 1024 positions) are computed chunk by chunk and combined."""
    g = torch.Generator().manual_seed(seed)
    num_slots = decodes * width + 1
    k_cache, v_cache = (torch.randn(num_slots, kv_heads, dim, generator=g).to(cache_dtype) for _ in range(2))
    # q as the model passes it: a strided view of the fused QKV rows (peaked softmaxes too)
    q = (torch.randn(decodes, kv_heads * group + 2, dim, generator=g) * 3)[:, 1:1 + kv_heads * group]
    lengths = torch.randint(1, width + 1, (decodes,), generator=g)
    lengths[0] = width
    slots = torch.randperm(num_slots, generator=g)[: decodes * width].view(decodes, width)
    out = cpu_kernels.decode_attention(q, k_cache, v_cache, slots, lengths, dim ** -0.5, isa=isa)
    torch.testing.assert_close(out, _sdpa_reference(q, k_cache, v_cache, slots, lengths), rtol=1e-5, atol=1e-5)
    assert out.dtype == torch.float32
    into = torch.full((decodes + 1, *q.shape[1:]), float("nan"))
    assert cpu_kernels.decode_attention(q, k_cache, v_cache, slots, lengths, dim ** -0.5, out=into[1:],
                                        isa=isa) is not None
    assert torch.equal(into[1:], out) and into[0].isnan().all()


@each_isa
@pytest.mark.parametrize("kv_heads, group, dim, cache_dtype", [(3, 3, 64, torch.float32), (1, 8, 128, torch.bfloat16),
                                                               (2, 6, 64, torch.bfloat16), (3, 1, 128, torch.float32)])
def test_decode_attention_bits_do_not_depend_on_the_batch(kv_heads, group, dim, cache_dtype, isa):
    """Threads take (request, KV head, chunk) items longest context first, one at a time: which thread computes an
    item, with which others, and on how many threads, must not change a result's bits; nor do a longer context's
    chunks, combined in their order."""
    g = torch.Generator().manual_seed(7)
    chunk = cpu_kernels.decode_attention_chunk(isa)
    decodes, width = 7, 3 * chunk
    num_slots = decodes * width + 1
    k_cache, v_cache = (torch.randn(num_slots, kv_heads, dim, generator=g).to(cache_dtype) for _ in range(2))
    q = torch.randn(decodes, kv_heads * group, dim, generator=g)
    # mixed, so the order of the items is not the batch's; one chunk, a chunk and a position, three chunks
    lengths = torch.tensor([5, chunk, 17, chunk + 1, 1, 33, 3 * chunk - 1])
    slots = torch.randperm(num_slots, generator=g)[: decodes * width].view(decodes, width)
    batch = cpu_kernels.decode_attention(q, k_cache, v_cache, slots, lengths, dim ** -0.5, isa=isa)
    threads = torch.get_num_threads()
    for d in range(decodes):
        alone = cpu_kernels.decode_attention(q[d:d + 1], k_cache, v_cache, slots[d:d + 1], lengths[d:d + 1],
                                             dim ** -0.5, isa=isa)
        assert torch.equal(alone[0], batch[d])
        torch.set_num_threads(1)
        try:
            assert torch.equal(cpu_kernels.decode_attention(q[d:d + 1], k_cache, v_cache, slots[d:d + 1],
                                                            lengths[d:d + 1], dim ** -0.5, isa=isa)[0], batch[d])
        finally:
            torch.set_num_threads(threads)
    reordered = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    assert torch.equal(cpu_kernels.decode_attention(q[reordered], k_cache, v_cache, slots[reordered],
                                                    lengths[reordered], dim ** -0.5, isa=isa), batch[reordered])


@each_isa
def test_decode_attention_ignores_padding_and_refuses_bad_slots(isa):
    k_cache, v_cache = torch.randn(10, 1, 64), torch.randn(10, 1, 64)
    q = torch.randn(2, 2, 64)
    slots = torch.tensor([[3, 4, 5], [7, 9, 9]])  # row 1 is padded past its length
    lengths = torch.tensor([3, 1])
    out = cpu_kernels.decode_attention(q, k_cache, v_cache, slots, lengths, 0.125, isa=isa)
    torch.testing.assert_close(out[1], v_cache[7].expand(2, 64))  # one key: the softmax is 1
    k_cache[9] = float("nan")  # what padding points at must never be read
    assert torch.equal(cpu_kernels.decode_attention(q, k_cache, v_cache, slots, lengths, 0.125, isa=isa), out)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.decode_attention(q, k_cache, v_cache, torch.tensor([[3, 4, 10], [7, 9, 9]]), lengths, 0.125,
                                     isa=isa)
    with pytest.raises(RuntimeError, match="length out of range"):
        cpu_kernels.decode_attention(q, k_cache, v_cache, slots, torch.tensor([4, 1]), 0.125, isa=isa)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        cpu_kernels.decode_attention(torch.randn(2, 2, 32), torch.randn(10, 1, 32), torch.randn(10, 1, 32), slots,
                                     lengths, 1.0, isa=isa)


@each_isa
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_is_index_copy(cache_dtype, isa):
    """fp32 rows into an fp32 cache, or rounded into a bf16 one as torch's .to() rounds them."""
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(20, 3, 64, generator=g).to(cache_dtype) for _ in range(2))
    qkv = torch.randn(5, 15, 64, generator=g)  # 9 query heads, then K and V: strided rows
    qkv[0, 9, :4] = torch.tensor([float("nan"), float("inf"), 1 + 2 ** -8, 1 + 3 * 2 ** -8])  # ties round to even
    k, v = qkv[:, 9:12], qkv[:, 12:]
    slots = torch.tensor([7, 0, 19, 3, 8])
    want_k = k_cache.clone().index_copy_(0, slots, k.to(cache_dtype))
    want_v = v_cache.clone().index_copy_(0, slots, v.to(cache_dtype))
    cpu_kernels.store_kv(k_cache, v_cache, slots, k, v, isa=isa)
    assert torch.equal(k_cache.isnan(), want_k.isnan()) and torch.equal(k_cache.nan_to_num(), want_k.nan_to_num())
    assert torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.store_kv(k_cache, v_cache, torch.tensor([7, 0, 20, 3, 8]), k, v, isa=isa)
    assert torch.equal(k_cache.nan_to_num(), want_k.nan_to_num())  # refused before anything was written
    with pytest.raises(RuntimeError, match="slot_mapping must be"):
        cpu_kernels.store_kv(k_cache, v_cache, slots[:4], k, v, isa=isa)
    # bf16 rows (a bf16 GEMM's product): copied into a bf16 cache, widened into an fp32 one
    narrow_v = qkv.bfloat16()[:, 12:]
    cpu_kernels.store_kv(k_cache, v_cache, slots, k, narrow_v, isa=isa)
    assert torch.equal(v_cache, v_cache.clone().index_copy_(0, slots, narrow_v.to(cache_dtype)))


@each_isa
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), cols=st.integers(1, 700), seed=st.integers(0, 2**31 - 1))
def test_add_rms_norm_matches_the_formula(rows, cols, seed, isa):
    from charioteer.model.llama import rms_norm

    g = torch.Generator().manual_seed(seed)
    x, delta, w = torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g), torch.randn(cols, generator=g)
    expected_x = x + delta
    start = x.clone()
    h = cpu_kernels.add_rms_norm_(x, delta, w, 1e-5, isa=isa)
    assert torch.equal(x, expected_x)  # the residual add is exact and in place
    torch.testing.assert_close(h, rms_norm(expected_x, w, 1e-5), rtol=1e-5, atol=1e-6)
    # a bf16 delta (a bf16 GEMM's product) and a bf16 norm (the next bf16 GEMM's input): the same
    # bits as widening the delta first and rounding the fp32 norm after
    narrow = delta.bfloat16()
    widened_x = start.clone()
    widened_h = cpu_kernels.add_rms_norm_(widened_x, narrow.float(), w, 1e-5, isa=isa)
    for bf16_out in (False, True):
        x = start.clone()
        h = cpu_kernels.add_rms_norm_(x, narrow, w, 1e-5, bf16_out=bf16_out, isa=isa)
        assert torch.equal(x, widened_x)
        assert torch.equal(h, widened_h.bfloat16() if bf16_out else widened_h)


@each_isa
def test_rms_norm_is_add_rms_norm_of_a_negative_zero_and_leaves_x(isa):
    """The first and last norms of a native-row-ops model: the later layers' kernel's bits, x untouched."""
    from charioteer.model.llama import rms_norm

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 576, generator=g), torch.randn(576, generator=g)
    x[0, :5] = -0.0
    start = x.clone()
    h = cpu_kernels.rms_norm(x, w, 1e-5, isa=isa)
    assert torch.equal(x, start) and torch.signbit(x[0, :5]).all()  # not written, -0.0 kept
    assert torch.equal(h, cpu_kernels.add_rms_norm_(start.clone(), torch.full_like(x, -0.0), w, 1e-5, isa=isa))
    torch.testing.assert_close(h, rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="x must be a 2-D fp32 tensor"):
        cpu_kernels.rms_norm(x.bfloat16(), w, 1e-5, isa=isa)


@each_isa
def test_rope_is_bitwise_the_formula(isa):
    from charioteer.model.llama import apply_rope

    g = torch.Generator().manual_seed(1)
    for dim in (64, 128):
        qkv = torch.randn(13, 7 * dim, generator=g)
        qk = qkv[:, : 5 * dim].view(13, 5, dim)  # strided rows, as sliced from the fused projection
        cos, sin = torch.randn(13, dim, generator=g), torch.randn(13, dim, generator=g)
        assert torch.equal(cpu_kernels.rope(qk, cos, sin, isa=isa), apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1)))
        narrow = qkv.bfloat16()[:, : 5 * dim].view(13, 5, dim)  # a bf16 product, widened exactly as read
        assert torch.equal(cpu_kernels.rope(narrow, cos, sin, isa=isa), cpu_kernels.rope(narrow.float(), cos, sin, isa=isa))


@each_isa
def test_silu_mul_matches_torch(isa):
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(9, 2 * 1000, generator=g) * 8  # reaches far into both tails of the sigmoid
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up, isa=isa), torch.nn.functional.silu(gate) * up,
                               rtol=2e-6, atol=1e-6)


@each_isa
def test_silu_mul_in_bf16_is_the_fp32_result_rounded(isa):
    """bf16 in and out: the fp32 kernel on the widened input, rounded to bf16 as torch rounds, bit for
    bit, in the vector body and the tail (1000 = 62 x 16 + 8 columns), for NaN and infinities too."""
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(9, 2 * 1000, generator=g) * 8).bfloat16()
    gate_up[0, :5] = torch.tensor([-200.0, 200.0, 0.0, float("nan"), float("inf")])
    gate_up[1, 1000 - 3:1000] = torch.tensor([float("nan"), -3.0, 1e30])  # the tail of the gate half
    expected = cpu_kernels.silu_mul(gate_up.float(), isa=isa).bfloat16()
    got = cpu_kernels.silu_mul(gate_up, isa=isa)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@each_isa
def test_argmax_rows_is_torch_argmax(isa):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 1000 + 7, generator=g)
    logits[1, 5] = logits[1, 900] = 50.0  # a tie: the first index wins
    logits[2, 1006] = 60.0  # in the tail past the last full vector
    logits[3, 10] = float("nan")  # NaN counts as the maximum
    logits[3, 20] = float("nan")
    logits[4] = float("-inf")
    logits[5, 77] = float("inf")
    assert torch.equal(cpu_kernels.argmax_rows(logits, isa=isa), logits.argmax(dim=-1))
    assert cpu_kernels.argmax_rows(torch.randn(0, 10), isa=isa).shape == (0,)
    # rows fewer than threads, as wide as a vocabulary: each row split over the threads
    wide, before = torch.randn(5, 40000 + 3, generator=g), torch.get_num_threads()
    wide[0, 30000] = 9.0  # the second part's maximum
    wide[1, 100] = wide[1, 30000] = 9.0  # a tie across the parts: the first wins
    wide[2, 35000] = float("nan")  # a NaN in the last part only
    wide[2, 10] = 9.0
    wide[3, 5], wide[3, 25000] = float("nan"), float("nan")
    wide[4] = float("-inf")
    try:
        for threads in (2, 3):
            torch.set_num_threads(threads)
            for rows in (wide[:1], wide[1:2], wide[2:3], wide[3:4], wide[4:], wide[:2]):
                assert torch.equal(cpu_kernels.argmax_rows(rows, isa=isa), rows.argmax(dim=-1))
    finally:
        torch.set_num_threads(before)


def test_greedy_takes_any_layout():
    from charioteer.engine.model_runner import greedy

    logits = torch.randn(50, 7)
    assert torch.equal(greedy(logits.T), logits.T.argmax(dim=-1))  # strided rows: torch's argmax
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))


def test_choice_follows_the_environment(monkeypatch):
    """CHARIOTEER_CPU_KERNELS forces a build or none; CHARIOTEER_AVX512=0 rules AVX-512 out."""
    runnable = [isa for isa in cpu_kernels.ISAS if cpu_kernels.cannot_run(isa) is None]
    monkeypatch.delenv("CHARIOTEER_AVX512", raising=False)
    for setting, want in [("off", None), ("auto", ([isa for isa in cpu_kernels.ISAS if isa in runnable] + [None])[0])]:
        monkeypatch.setenv("CHARIOTEER_CPU_KERNELS", setting)
        assert cpu_kernels.choose_isa()[0] == want
    for isa in cpu_kernels.ISAS:
        monkeypatch.setenv("CHARIOTEER_CPU_KERNELS", isa)
        chosen, why = cpu_kernels.choose_isa()
        assert (chosen, why) == ((isa, None) if isa in runnable else (None, f"{isa}: {cpu_kernels.cannot_run(isa)}"))
    monkeypatch.setenv("CHARIOTEER_CPU_KERNELS", "avx512")
    monkeypatch.setenv("CHARIOTEER_AVX512", "0")
    assert cpu_kernels.choose_isa()[0] is None
    monkeypatch.setenv("CHARIOTEER_CPU_KERNELS", "sse")
    assert "none of avx512, avx2, off, auto" in cpu_kernels.choose_isa()[1]


_GENERATE = """
import json
import sys
sys.path.insert(0, {tests!r})
from texts import PASSAGE
from charioteer import LLM, SamplingParams
from charioteer.model import cpu_kernels
words = PASSAGE.split()
prompts = [" ".join(words[:n]) for n in (12, 40, 75, 110, 20)]
llm = LLM(max_num_seqs=4, chunk_size=32)  # the default model: chunks mixed with decodes, and decode-only steps
outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, logprobs=1))
print(json.dumps({{"isa": cpu_kernels.chosen_isa(), "tokens": [o.outputs[0].token_ids for o in outs],
                  "logprobs": [[lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                               for o in outs]}}))
"""


def _generate(setting: str) -> dict:
    """The default model's greedy tokens and their logprobs, in a process with CHARIOTEER_CPU_KERNELS=setting."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, CHARIOTEER_CPU_KERNELS=setting)
    env.pop("CHARIOTEER_AVX512", None)
    script = _GENERATE.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fallback_outputs() -> dict:
    return _generate("off")


@each_isa
def test_each_build_gives_the_fallbacks_greedy_outputs(fallback_outputs, isa):
    """The default model on each build (as forced on any CPU that runs it) against MKL and SDPA alone
    (CHARIOTEER_CPU_KERNELS=off, as on a CPU without AVX2 or a compiler): the same greedy tokens."""
    native = _generate(isa)
    assert native["isa"] == isa and fallback_outputs["isa"] is None
    assert native["tokens"] == fallback_outputs["tokens"]
    for a, b in zip(native["logprobs"], fallback_outputs["logprobs"]):
        assert a == pytest.approx(b, abs=1e-3)


def _tile_kernel(name: str):
    """cpu_kernels' tile-order bf16 GEMM `name`, or a skip where it does not run here."""
    reason = cpu_kernels.amx_unavailable_reason() if name == "amx" else cpu_kernels.avx512_bf16_unavailable_reason()
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    return cpu_kernels.amx_linear if name == "amx" else cpu_kernels.avx512_bf16_linear


@pytest.mark.parametrize("kernel", ["amx", "avx512_bf16"])
def test_tile_order_bf16_gemms_are_the_bf16_product_and_a_row_does_not_depend_on_its_batch(kernel):
    """amx_linear and avx512_bf16_linear: bf16 x @ w.T with fp32 sums (one order apart from torch's),
    the bf16 output that result rounded; x read in place (strided rows too) or copied for a K that
    does not tile; AMX's one or two row tiles per pass, AVX512-BF16's row blocks of 8 and their
    remainders, one or two column blocks per pair (n = 96, 100, 48); a K long enough for AMX to run it
    in chunks from 64 rows (k = 9000: x's rows and a pair's weight past the L2 budget); each row's
    bits the same in a batch of any size."""
    linear = _tile_kernel(kernel)
    torch.manual_seed(0)
    for n, k in ((96, 128), (100, 70), (48, 576), (48, 9000)):
        w = torch.randn(n, k).bfloat16()
        packed = cpu_kernels.amx_pack(w)
        assert packed.shape == (-(-n // 16), -(-k // 32), 16, 32)
        wide = torch.randn(130, k + 16).bfloat16()
        alone = {}
        for m in (1, 5, 16, 17, 33, 64, 65, 130):
            # contiguous, and rows k + 16 apart
            for strided, x in ((False, wide[:m, :k].contiguous()), (True, wide[:m, 8:8 + k])):
                reference = x.float() @ w.float().T
                out = linear(x, packed, n)
                # |out| ~ sqrt(k); AVX512-BF16 sums k in one sequence, so its error grows with k
                torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4 * max(1, k / 1024))
                assert torch.equal(linear(x, packed, n, bf16_output=True), out.bfloat16())
                if kernel == "avx512_bf16":  # fp32 x rounded as .to(bf16) rounds it; into a given buffer
                    wider = x.float() + torch.randn(x.shape) * 1e-3
                    into = torch.empty(m, n, dtype=torch.bfloat16)
                    assert linear(wider, packed, n, bf16_output=True, out=into) is into
                    assert torch.equal(into, linear(wider.bfloat16(), packed, n, bf16_output=True))
                for i in range(m):
                    row = alone.setdefault((i, strided), linear(x[i:i + 1], packed, n))
                    assert torch.equal(out[i], row[0]), (n, k, m, i)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        linear(torch.randn(4, 64).bfloat16(), packed, 48)


def _int8_tile_kernel(name: str, monkeypatch):
    """The int8 GEMM of tile kernel `name`, with the environment set for Kernels.choose to take it (on an
    AMX CPU, avx512_bf16 needs CHARIOTEER_AMX_INT8=0), or a skip where it does not run here."""
    from charioteer.model.llama import tile_linear_int8

    if name == "avx512_bf16":
        monkeypatch.setenv("CHARIOTEER_AMX_INT8", "0")
    reason = (cpu_kernels.amx_int8_unavailable_reason() if name == "amx"
              else cpu_kernels.avx512_bf16_unavailable_reason())
    if reason is not None:
        pytest.skip(f"int8 on {name}: {reason}")
    return tile_linear_int8(name)


INT16_TOP = 32639  # amx_linear_int8's largest int16 value of a row of x (its high byte fits int8)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 70), n=st.integers(1, 100), k=st.integers(1, 300), scale_x=st.sampled_from([1e-3, 1.0, 1e3]),
       seed=st.integers(0, 2**31 - 1))
def test_amx_int8_is_x_quantized_per_row_to_int16_times_the_exact_weight(rows, n, k, scale_x, seed, monkeypatch):
    """amx_linear_int8 on the panel kernel's int8 panels: each row of x quantized to int16 with its own
    scale (x times 32639 / its largest magnitude, in fp32, to nearest even), times q exactly, times both
    scales; so within largest / 65278 per value of the exact product (bf16's rounding would be 1/512 of
    each value), whatever K's remainder (garbage in the tiles' tail would come out as noise) and the row
    count (1-5 passes of 16); a row of zeros gives zeros."""
    int8_linear = _int8_tile_kernel("amx", monkeypatch)
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g) * scale_x, torch.randn(n, k, generator=g)
    x[0] = 0
    q, scale = quantize_int8(w)
    out = int8_linear(x, cpu_kernels.pack(q), n, scale)
    largest = x.abs().amax(1, keepdim=True)
    inverse = torch.where(largest > 0, torch.full_like(largest, INT16_TOP) / largest, torch.zeros_like(largest))
    v = torch.round(x * inverse)
    assert v.abs().max() <= INT16_TOP
    weight = q.double() * scale.double()[:, None]
    quantized = ((v.double() @ weight.T) * (largest.double() / INT16_TOP)).float()
    torch.testing.assert_close(out, quantized, rtol=1e-5, atol=1e-6 * scale_x)
    assert torch.equal(out[0], torch.zeros(n))
    bound = largest.double() / (2 * INT16_TOP) * weight.abs().sum(1)[None, :] * 1.01 + 1e-6 * scale_x
    assert ((out.double() - x.double() @ weight.T).abs() <= bound).all()


def test_amx_int8_gives_nan_for_a_row_holding_one_and_only_for_it(monkeypatch):
    """A NaN anywhere in a row of x (vmaxps would drop one met before the last step) makes that row's products
    NaN, as fp32 or bf16 arithmetic would; the other rows are what they are without it."""
    int8_linear = _int8_tile_kernel("amx", monkeypatch)
    x, w = torch.randn(20, 200), torch.randn(40, 200)
    q, scale = quantize_int8(w)
    panels = cpu_kernels.pack(q)
    clean = int8_linear(x, panels, 40, scale)
    x[3, 5] = x[17, 199] = float("nan")
    out = int8_linear(x, panels, 40, scale)
    assert out[3].isnan().all() and out[17].isnan().all()
    rest = [i for i in range(20) if i not in (3, 17)]
    assert torch.equal(out[rest], clean[rest])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 70), n=st.integers(1, 100), k=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_avx512_bf16_int8_is_its_bf16_product_on_the_int8_panels(rows, n, k, seed, monkeypatch):
    """avx512_bf16_linear_int8 reads the panel kernel's int8 panels and widens them to bf16 exactly: the
    same bits as its bf16 GEMM on q in bf16 times the column scales, whatever K's remainder (the widened
    tail must be zeros: garbage there would come out as NaN or noise), and within fp32 rounding of x
    rounded to bf16 times the exact int8 weight."""
    int8_linear = _int8_tile_kernel("avx512_bf16", monkeypatch)
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    q, scale = quantize_int8(w)
    out = int8_linear(x, cpu_kernels.pack(q), n, scale)
    tiles = _tile_kernel("avx512_bf16")(x.bfloat16(), cpu_kernels.amx_pack(q.bfloat16()), n) * scale
    assert torch.equal(out, tiles)
    exact = (x.bfloat16().double() @ (q.double() * scale.double()[:, None]).T).float()
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("kernel", ["amx", "avx512_bf16"])
def test_int8_runs_a_tile_kernel_from_its_rows_and_its_switch_keeps_the_panel_kernel(kernel, monkeypatch):
    """int8 weights take the tile kernel from INT8_TILE_MIN_ROWS rows on, on the panels the panel kernel
    reads below them (one copy of the weight); a row's bits on the tile kernel do not depend on its batch.
    The cost model's small-batch rows end where the tile kernel begins. The kernel's switches
    (CHARIOTEER_AMX_INT8 or CHARIOTEER_AMX; CHARIOTEER_AVX512_BF16) each turn it off, and with both kinds
    off every batch runs the panel kernel."""
    from charioteer.model.config import ModelConfig
    from charioteer.model.llama import INT8_TILE_MIN_ROWS, Kernels

    int8_linear = _int8_tile_kernel(kernel, monkeypatch)
    config = ModelConfig(name="t", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1,
                         num_kv_heads=1)
    kernels = Kernels.choose(config, torch.device("cpu"), quantized=True)
    assert (kernels.int8_tile_rows, kernels.int8_tile_kernel) == (INT8_TILE_MIN_ROWS, kernel)
    assert kernels.small_batch_rows(quantized=True) == INT8_TILE_MIN_ROWS - 1
    lin = Int8Linear(torch.randn(96, 128), torch.float32, kernels.panel_rows, INT8_TILE_MIN_ROWS, kernel)
    small, large = torch.randn(INT8_TILE_MIN_ROWS - 1, 128), torch.randn(3 * INT8_TILE_MIN_ROWS, 128)
    assert torch.equal(lin(small), cpu_kernels.linear(small, lin.panels, 96, lin.scale))
    out = lin(large)
    assert torch.equal(out, int8_linear(large, lin.panels, 96, lin.scale))
    assert torch.equal(out[:INT8_TILE_MIN_ROWS], lin(large[:INT8_TILE_MIN_ROWS]))
    with pytest.raises(ValueError, match="give panel_rows"):
        Int8Linear(torch.randn(96, 128), torch.float32, tile_rows=INT8_TILE_MIN_ROWS, tile_kernel=kernel)
    with pytest.raises(ValueError, match="both"):
        Int8Linear(torch.randn(96, 128), torch.float32, kernels.panel_rows, tile_rows=INT8_TILE_MIN_ROWS)
    with pytest.raises(ValueError, match="int8_tile_kernel"):
        dataclasses.replace(kernels, int8_tile_kernel=None)
    for switch in ("CHARIOTEER_AMX_INT8", "CHARIOTEER_AMX") if kernel == "amx" else ("CHARIOTEER_AVX512_BF16",):
        monkeypatch.setenv(switch, "0")
        assert Kernels.choose(config, torch.device("cpu"), quantized=True).int8_tile_kernel != kernel
        monkeypatch.delenv(switch)
    monkeypatch.setenv("CHARIOTEER_AMX_INT8", "0")
    monkeypatch.setenv("CHARIOTEER_AVX512_BF16", "0")
    assert Kernels.choose(config, torch.device("cpu"), quantized=True).int8_tile_rows == 0


_VNNI_BLOCK = 128  # x values per int16 scale in vnni_linear_int8
needs_vnni = pytest.mark.skipif(cpu_kernels.vnni_unavailable_reason() is not None,
                                reason=f"AVX512-VNNI: {cpu_kernels.vnni_unavailable_reason()}")


def _blockwise_int16_product(x, q, scale):
    """(vnni_linear_int8's product, the bound on its distance from the exact one), in float64: each block of
    128 values of a row of x rounded to int16 at its largest magnitude / 32767, times q exactly, times the
    block's scale, summed, times the column scale; each value is then off by at most half a step."""
    out = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float64)
    bound = torch.zeros_like(out)
    for k0 in range(0, x.shape[1], _VNNI_BLOCK):
        block, weights = x[:, k0:k0 + _VNNI_BLOCK], q[:, k0:k0 + _VNNI_BLOCK].double()
        top = block.abs().amax(1, keepdim=True)
        # 32767 / top in fp32, as the kernel (torch's `32767.0 / top` multiplies by top's reciprocal: another rounding)
        inv = torch.where(top > 0, torch.full_like(top, 32767.0) / top, torch.zeros_like(top))
        quantized = torch.round(block * inv).clamp(-32767, 32767).double()
        out += (quantized @ weights.T) * (top / 32767.0).double()
        bound += (top / 65534.0).double() * weights.abs().sum(1)
    return out * scale.double(), bound * scale.double()


@needs_vnni
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 20), n=st.integers(1, 100), k=st.integers(1, 400), outlier=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_vnni_int8_is_the_blockwise_int16_product(rows, n, k, outlier, seed):
    """vnni_linear_int8 on the panel kernel's int8 panels: x quantized to int16 per block of 128 values, the
    products summed exactly per block (within fp32 rounding of the float64 reference), whatever K's remainder
    (odd K pads the last pair); off the exact product by no more than half an int16 step of each block
    (an outlier 1000 times the others coarsens its own block only); a row's bits do not depend on the batch,
    its place in it, or strided rows."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    if outlier:
        x[:, 0] *= 1000.0
    q, scale = quantize_int8(w)
    panels = cpu_kernels.pack(q)
    out = cpu_kernels.vnni_linear_int8(x, panels, n, scale)
    reference, bound = _blockwise_int16_product(x, q, scale)
    magnitude = (x.double().abs() @ (q.double().abs() * scale.double()[:, None]).T)  # the sum of |terms|
    assert ((out.double() - reference).abs() <= 1e-6 * magnitude + 1e-30).all()
    error = (out.double() - x.double() @ (q.double() * scale.double()[:, None]).T).abs()
    assert (error <= bound + 1e-6 * magnitude + 1e-30).all()
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(cpu_kernels.vnni_linear_int8(x[i:i + 1], panels, n, scale)[0], out[i])
    strided = torch.cat([x, x], 1)[:, :k]
    assert torch.equal(cpu_kernels.vnni_linear_int8(strided, panels, n, scale), out)


@needs_vnni
def test_int8_takes_vnni_below_the_tile_rows_and_its_switch_keeps_the_panel_kernel(monkeypatch):
    """Where AVX512-VNNI runs, int8 batches below the tile kernels' rows (all rows the panels take, without
    them) run vnni_linear_int8 on the same panels; CHARIOTEER_VNNI=0 keeps the panel kernel; VNNI needs
    the panels."""
    from charioteer.model.config import ModelConfig
    from charioteer.model.llama import Kernels
    from charioteer.model.llama import tile_linear_int8 as llama_tile_int8

    config = ModelConfig(name="t", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1,
                         num_kv_heads=1)
    kernels = Kernels.choose(config, torch.device("cpu"), quantized=True)
    assert kernels.int8_vnni and not Kernels.choose(config, torch.device("cpu")).int8_vnni  # int8 only
    assert not kernels.gguf_vnni and Kernels.choose(config, torch.device("cpu"), gguf=True).gguf_vnni
    with pytest.raises(ValueError, match="gguf_vnni and gguf_int8_activations run the GGUF kernel"):
        dataclasses.replace(kernels, gguf_vnni=True)
    with pytest.raises(ValueError, match="gguf_vnni and gguf_int8_activations run the GGUF kernel"):
        dataclasses.replace(kernels, gguf_int8_activations=True)
    lin = Int8Linear(torch.randn(96, 128), torch.float32, kernels.panel_rows, kernels.int8_tile_rows,
                     kernels.int8_tile_kernel, vnni=True)
    small = torch.randn(3, 128)
    assert torch.equal(lin(small), cpu_kernels.vnni_linear_int8(small, lin.panels, 96, lin.scale))
    if kernels.int8_tile_rows:
        large = torch.randn(kernels.int8_tile_rows, 128)
        assert torch.equal(lin(large), llama_tile_int8(kernels.int8_tile_kernel)(large, lin.panels, 96, lin.scale))
    with pytest.raises(ValueError, match="give panel_rows"):
        Int8Linear(torch.randn(96, 128), torch.float32, vnni=True)
    with pytest.raises(ValueError, match="int8_vnni"):
        dataclasses.replace(kernels, panel_rows=0, int8_tile_rows=0, int8_tile_kernel=None)
    monkeypatch.setenv("CHARIOTEER_VNNI", "0")
    assert cpu_kernels.vnni_unavailable_reason() == "disabled by CHARIOTEER_VNNI=0"
    assert not Kernels.choose(config, torch.device("cpu"), quantized=True).int8_vnni
    assert not Kernels.choose(config, torch.device("cpu"), gguf=True).gguf_vnni


def test_vnni_needs_the_avx512_build_and_the_instructions(monkeypatch):
    monkeypatch.delenv("CHARIOTEER_VNNI", raising=False)  # the switch's own reason would come first
    monkeypatch.setattr(cpu_kernels, "chosen_isa", lambda: "avx2")
    assert cpu_kernels.vnni_unavailable_reason() == "it is in the avx512 build only, and the kernels here are avx2"
    monkeypatch.setattr(cpu_kernels, "chosen_isa", lambda: "avx512")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx512f"})
    assert cpu_kernels.vnni_unavailable_reason() == "the CPU lacks avx512_vnni"


def _causal_attention_fp32(q, k, v, start):
    """The chunk's attention in fp32 on the same bf16 inputs: the reference both bf16 paths are held to."""
    n, keys = q.shape[0], k.shape[0]
    mask = torch.arange(keys)[None, :] <= torch.arange(start, start + n)[:, None]
    qs, ks, vs = (t.float().transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)


def _within_sdpas_bf16_error(attend, head_shapes) -> tuple:
    """`attend(q, k, v, start, scale, out)` against fp32 attention on the same bf16 inputs, for
    `head_shapes` (heads, KV heads, head size), chunks that fill no tile or several, at the start of
    a prompt or deep in it, strided rows in and out: no further from it than torch's SDPA in bf16 (the
    path it replaces); with out=None, a bf16 result equal to the fp32 one rounded. Returns the last
    (q, k, v, start)."""
    torch.manual_seed(0)
    for heads, kv_heads, dim in head_shapes:
        for start, n in ((0, 1), (0, 17), (5, 1), (100, 7), (0, 130), (200, 48), (1000, 33)):
            keys = start + n
            q = torch.randn(n, heads + 2, dim).bfloat16()[:, 1:heads + 1]  # rows (heads + 2) * dim apart
            k, v = (torch.randn(keys, kv_heads, dim).bfloat16() for _ in range(2))
            reference = _causal_attention_fp32(q, k, v, start)
            mask = torch.arange(keys)[None, :] <= torch.arange(start, start + n)[:, None]
            sdpa = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), attn_mask=mask,
                enable_gqa=True)[0].transpose(0, 1).float()
            bound = max(1.5 * (sdpa - reference).abs().max().item(), 1e-3)
            wide = torch.full((n, heads + 1, dim), float("nan"))
            out = attend(q, k, v, start, dim ** -0.5, wide[:, :heads])
            assert torch.isnan(wide[:, heads]).all(), "wrote past its rows"
            assert (out - reference).abs().max().item() <= bound, (heads, kv_heads, dim, start, n)
            as_bf16 = attend(q, k, v, start, dim ** -0.5, None)
            assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16, out.bfloat16())
    return q, k, v, start


@each_isa
@pytest.mark.skipif(not cpu_kernels.amx_available(), reason=f"AMX tiles: {cpu_kernels.amx_unavailable_reason()}")
def test_amx_prefill_attention_is_causal_attention_within_sdpas_bf16_error(isa):
    def attend(q, k, v, start, scale, out):
        return cpu_kernels.amx_prefill_attention(q, k, v, start, scale, out=out, isa=isa)

    q, k, v, start = _within_sdpas_bf16_error(attend, ((9, 3, 64), (4, 4, 128), (4, 2, 32)))
    # KV heads that divide among the threads are laid out one at a time per thread, others all first: the
    # same bits (3 KV heads on 1 thread, then on 2)
    chunk = [torch.randn(rows, heads, 64).bfloat16() for rows, heads in ((70, 9), (100, 3), (100, 3))]
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(attend(*chunk, 30, 0.125, None))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*results)
    # fp32 q is rounded to bf16 as each block takes it (to nearest even, as .to): the bits of q rounded first
    wide_q = q.float() + torch.randn(q.shape) * 1e-3
    assert torch.equal(attend(wide_q, k, v, start, 0.125, None), attend(wide_q.bfloat16(), k, v, start, 0.125, None))
    with pytest.raises(RuntimeError, match="start \\+ the chunk's tokens"):
        cpu_kernels.amx_prefill_attention(q, k[:-1], v[:-1], start, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_kernels.amx_prefill_attention(*(torch.zeros(4, 2, 48).bfloat16() for _ in range(3)), 0, 0.125)


@pytest.mark.skipif(cpu_kernels.avx512_bf16_unavailable_reason() is not None,
                    reason=f"AVX512-BF16: {cpu_kernels.avx512_bf16_unavailable_reason()}")
def test_prefill_attention_on_bf16_products_is_within_sdpas_bf16_error():
    def attend(q, k, v, start, scale, out):
        return cpu_kernels.prefill_attention(q, k, v, start, scale, out=out, bf16_products=True, isa="avx512")

    q, k, v, start = _within_sdpas_bf16_error(attend, ((9, 3, 64), (4, 4, 128), (8, 2, 64)))
    with pytest.raises(RuntimeError, match="bf16 products take bf16 K and V"):
        cpu_kernels.prefill_attention(q, k.float(), v.float(), start, 0.125, bf16_products=True, isa="avx512")
    if cpu_kernels.load_reason("avx2") is None:
        with pytest.raises(RuntimeError, match="avx512 build only"):
            cpu_kernels.prefill_attention(q, k, v, start, 0.125, bf16_products=True, isa="avx2")


@each_isa
def test_prefill_attention_is_causal_attention_in_fp32(isa):
    """prefill_attention against causal attention in fp64 on the same inputs: fp32 q, K, V and out
    within fp32's rounding; bf16 K and V (the widened cache) and q widened exactly, so as close to
    the fp64 result on them; bf16 out is the fp32 out rounded. GQA and plain heads, head sizes 64
    and 128, chunks of 1 to 130 tokens at the start of a prompt or deep in it, strided rows in and out."""
    torch.manual_seed(0)
    for heads, kv_heads, dim in ((9, 3, 64), (4, 4, 128), (8, 2, 64)):
        for start, n in ((0, 1), (0, 17), (5, 1), (100, 7), (0, 130), (200, 48), (1000, 33)):
            keys = start + n
            q = torch.randn(n, heads + 2, dim)[:, 1:heads + 1]  # rows (heads + 2) * dim apart
            k, v = (torch.randn(keys, kv_heads, dim) for _ in range(2))
            for dtype in (torch.float32, torch.bfloat16):
                qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
                reference = _causal_attention(qd.double(), kd.double(), vd.double(), start)
                wide = torch.full((n, heads + 1, dim), float("nan"))
                out = cpu_kernels.prefill_attention(qd, kd, vd, start, dim ** -0.5, out=wide[:, :heads], isa=isa)
                assert torch.isnan(wide[:, heads]).all(), "wrote past its rows"
                assert (out.double() - reference).abs().max().item() < 2e-6, (heads, kv_heads, dim, start, n, dtype)
                narrow = torch.empty(q.shape).bfloat16()
                cpu_kernels.prefill_attention(qd, kd, vd, start, dim ** -0.5, out=narrow, isa=isa)
                assert torch.equal(narrow, out.bfloat16())
    with pytest.raises(RuntimeError, match="start \\+ the chunk's tokens"):
        cpu_kernels.prefill_attention(q, k[:-1], v[:-1], start, 0.125, isa=isa)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple"):
        cpu_kernels.prefill_attention(*(torch.zeros(4, 2, 48) for _ in range(3)), 0, 0.125, isa=isa)
    with pytest.raises(RuntimeError, match="k and v must be alike"):
        cpu_kernels.prefill_attention(q, k, v.bfloat16(), start, 0.125, isa=isa)


def _causal_attention(q, k, v, start):
    n, keys = q.shape[0], k.shape[0]
    mask = torch.arange(keys)[None, :] <= torch.arange(start, start + n)[:, None]
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def test_prompt_chunks_attend_in_the_vector_kernel_unless_amx_tiles_or_its_switch_say_otherwise(monkeypatch):
    from charioteer.model.config import ModelConfig
    from charioteer.model.llama import Kernels

    config = ModelConfig(name="t", vocab_size=8, hidden_size=576, intermediate_size=8, num_layers=1, num_heads=9,
                         num_kv_heads=3)
    cpu = torch.device("cpu")
    for env in ("CHARIOTEER_VECTOR_ATTENTION", "CHARIOTEER_CPU_KERNELS", "CHARIOTEER_AMX", "CHARIOTEER_BF16_COMPUTE"):
        monkeypatch.delenv(env, raising=False)
    chosen = Kernels.choose(config, cpu)
    assert chosen.vector_attention == cpu_kernels.available()
    assert Kernels.choose(config, cpu, quantized=True).vector_attention == cpu_kernels.available()
    assert not Kernels.choose(config, cpu, batch_invariant=True).vector_attention  # one query at a time there
    bf16 = Kernels.choose(config, cpu, torch.bfloat16)
    # widened bf16 attends on its bf16 cache in fp32, except where AMX computes bf16 (SDPA in bf16, or the tiles)
    assert bf16.vector_attention == (bf16.widened_bf16 and bf16.tile_kernel != "amx")
    assert not (bf16.vector_attention and bf16.amx_attention)
    monkeypatch.setenv("CHARIOTEER_VECTOR_ATTENTION", "0")
    assert Kernels.choose(config, cpu) == dataclasses.replace(chosen, vector_attention=False)
    monkeypatch.setenv("CHARIOTEER_VECTOR_ATTENTION", "yes")
    with pytest.raises(ValueError, match="neither 0 nor 1"):
        Kernels.choose(config, cpu)
    with pytest.raises(ValueError, match="not both"):
        Kernels(panel_rows=32, packed_gemm=False, row_ops=True, decode_attention=True, decode_layers=False,
                widened_bf16=True, native_bf16_rows=9, amx_attention=True, vector_attention=True)


@pytest.mark.skipif(not cpu_kernels.amx_available(), reason=f"AMX tiles: {cpu_kernels.amx_unavailable_reason()}")
def test_widened_bf16_runs_amx_tiles_below_torchs_gemm_and_amx_0_turns_them_off(monkeypatch):
    from charioteer.model.config import ModelConfig
    from charioteer.model.llama import AMX_MAX_ROWS, NATIVE_BF16_MIN_ROWS, Kernels, NarrowLinear, amx_attention_enabled

    config = ModelConfig(name="t", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1,
                         num_kv_heads=1)
    monkeypatch.setenv("CHARIOTEER_BF16_COMPUTE", "widened")
    monkeypatch.setenv("CHARIOTEER_NATIVE_BF16_GEMM", "1")
    kernels = Kernels.choose(config, torch.device("cpu"), torch.bfloat16)
    assert kernels.tile_kernel == "amx" and kernels.native_bf16_rows == AMX_MAX_ROWS + 1
    # prompt attention on the tiles by default, for one query head per KV head as for several
    assert kernels.amx_attention
    grouped = dataclasses.replace(config, num_heads=3, hidden_size=192)
    assert Kernels.choose(grouped, torch.device("cpu"), torch.bfloat16).amx_attention
    monkeypatch.setenv("CHARIOTEER_AMX_ATTENTION", "1")
    assert Kernels.choose(config, torch.device("cpu"), torch.bfloat16) == kernels
    monkeypatch.setenv("CHARIOTEER_AMX_ATTENTION", "0")
    assert Kernels.choose(config, torch.device("cpu"), torch.bfloat16) == dataclasses.replace(kernels, amx_attention=False)
    assert not Kernels.choose(grouped, torch.device("cpu"), torch.bfloat16).amx_attention
    monkeypatch.setenv("CHARIOTEER_AMX_ATTENTION", "1")  # head sizes the kernel cannot run stay on SDPA
    assert not amx_attention_enabled(dataclasses.replace(config, hidden_size=48, head_dim=48))
    assert not amx_attention_enabled(dataclasses.replace(config, hidden_size=256, head_dim=256))
    monkeypatch.setenv("CHARIOTEER_AMX_ATTENTION", "yes")
    with pytest.raises(ValueError, match="none of 0, 1, auto"):
        Kernels.choose(grouped, torch.device("cpu"), torch.bfloat16)
    monkeypatch.delenv("CHARIOTEER_AMX_ATTENTION")
    assert kernels.small_batch_rows(quantized=False) == AMX_MAX_ROWS and kernels.widen_rows(quantized=False) == 0
    w = torch.randn(96, 128).bfloat16()
    lin = NarrowLinear(w, None, kernels.panel_rows, kernels.native_bf16_rows, tile_kernel="amx")
    small, large = torch.randn(AMX_MAX_ROWS, 128), torch.randn(AMX_MAX_ROWS + 1, 128)
    assert torch.equal(lin(small), cpu_kernels.amx_linear(small.bfloat16(), lin.panels, 96).bfloat16().float())
    torch.testing.assert_close(lin(large), torch.nn.functional.linear(large.bfloat16(), w).float(),
                               rtol=2 ** -7, atol=1e-6)
    with pytest.raises(ValueError, match="give native_rows"):
        NarrowLinear(w, None, kernels.panel_rows, tile_kernel="amx")
    monkeypatch.setenv("CHARIOTEER_AMX", "0")
    monkeypatch.setenv("CHARIOTEER_AVX512_BF16", "0")
    assert cpu_kernels.amx_unavailable_reason() == "disabled by CHARIOTEER_AMX=0"
    off = Kernels.choose(config, torch.device("cpu"), torch.bfloat16)
    assert off.tile_kernel is None and not off.amx_attention and off.native_bf16_rows == NATIVE_BF16_MIN_ROWS


@pytest.mark.skipif(cpu_kernels.avx512_bf16_unavailable_reason() is not None,
                    reason=f"AVX512-BF16 kernel: {cpu_kernels.avx512_bf16_unavailable_reason()}")
def test_widened_bf16_runs_avx512_bf16_below_torchs_gemm_without_amx_and_its_switch_turns_it_off(monkeypatch):
    """Where AMX does not run (here forced off), AVX512-BF16's kernel takes the rows below oneDNN's
    GEMM on the weight in tile order; CHARIOTEER_AVX512_BF16=0 leaves them on the panel kernel."""
    from charioteer.model.config import ModelConfig
    from charioteer.model.llama import AVX512_BF16_MAX_ROWS, NATIVE_BF16_MIN_ROWS, Kernels, NarrowLinear

    config = ModelConfig(name="t", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1,
                         num_kv_heads=1)
    monkeypatch.setenv("CHARIOTEER_BF16_COMPUTE", "widened")
    monkeypatch.setenv("CHARIOTEER_NATIVE_BF16_GEMM", "1")
    monkeypatch.setenv("CHARIOTEER_AMX", "0")
    kernels = Kernels.choose(config, torch.device("cpu"), torch.bfloat16)
    assert kernels.tile_kernel == "avx512_bf16" and kernels.native_bf16_rows == AVX512_BF16_MAX_ROWS + 1
    assert not kernels.amx_attention and kernels.widen_rows(quantized=False) == 0
    w = torch.randn(96, 128).bfloat16()
    lin = NarrowLinear(w, None, kernels.panel_rows, kernels.native_bf16_rows, tile_kernel="avx512_bf16")
    small, large = torch.randn(AVX512_BF16_MAX_ROWS, 128), torch.randn(AVX512_BF16_MAX_ROWS + 1, 128)
    expected = cpu_kernels.avx512_bf16_linear(small.bfloat16(), lin.panels, 96).bfloat16().float()
    assert torch.equal(lin(small), expected)
    torch.testing.assert_close(lin(large), torch.nn.functional.linear(large.bfloat16(), w).float(),
                               rtol=2 ** -7, atol=1e-6)
    monkeypatch.setenv("CHARIOTEER_AVX512_BF16", "0")
    assert cpu_kernels.avx512_bf16_unavailable_reason() == "disabled by CHARIOTEER_AVX512_BF16=0"
    monkeypatch.setenv("CHARIOTEER_AVX512_BF16", "1")
    assert "avx512 build only" in cpu_kernels.avx512_bf16_unavailable_reason(isa="avx2")
    monkeypatch.setenv("CHARIOTEER_AVX512_BF16", "0")
    off = Kernels.choose(config, torch.device("cpu"), torch.bfloat16)
    assert off.tile_kernel is None and off.native_bf16_rows == NATIVE_BF16_MIN_ROWS
    with pytest.raises(ValueError, match="none of"):
        dataclasses.replace(off, tile_kernel="tiles")


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path):
    """torch's build lock has no timeout: a stale one would stall every later load of the kernels."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    cpu_kernels.clear_stale_lock(tmp_path)
    assert lock.exists(), "a build may be running: its lock stays"
    old = time.time() - cpu_kernels.STALE_BUILD_LOCK_S - 5
    os.utime(lock, (old, old))
    cpu_kernels.clear_stale_lock(tmp_path)
    assert not lock.exists()
    cpu_kernels.clear_stale_lock(tmp_path)  # and no lock at all is fine


def test_each_checkout_builds_in_a_folder_of_its_own(monkeypatch, tmp_path):
    """The build files name the sources by absolute path: two checkouts sharing a folder rebuild it in turn."""
    here = cpu_kernels._build_directory("avx2")
    copies = [tmp_path / name / "kernels" for name in ("a", "b")]
    for copy in copies:
        copy.mkdir(parents=True)
        for p in cpu_kernels._SOURCES + cpu_kernels._HEADERS:
            (copy / p.name).write_bytes(p.read_bytes())
    folders = []
    for copy in copies:
        monkeypatch.setattr(cpu_kernels, "_SOURCES", [copy / p.name for p in cpu_kernels._SOURCES])
        monkeypatch.setattr(cpu_kernels, "_HEADERS", [copy / p.name for p in cpu_kernels._HEADERS])
        monkeypatch.setattr(cpu_kernels, "_BUILD_CACHE", tmp_path / "cache")
        folders.append(cpu_kernels._build_directory("avx2").name)
    assert len({here.name, *folders}) == 3
