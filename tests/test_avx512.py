"""The AVX-512 panel GEMM (charioteer/model/kernels/avx512.cpp) against float64, and its batch invariance."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from charioteer.model import avx512
from charioteer.model.llama import Linear

pytestmark = pytest.mark.skipif(not avx512.available(), reason=f"panel GEMM: {avx512.unavailable_reason()}")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 100), k=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_matches_float64(rows, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    y = avx512.linear(x, avx512.pack(w), n)
    assert y.shape == (rows, n)
    torch.testing.assert_close(y, _reference(x, w), rtol=1e-4, atol=1e-4 * k**0.5)


def test_rows_do_not_depend_on_the_batch():
    """Sums run over k in order per output, so a row's bits are the same alone, shuffled or in any batch."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 1536, generator=g)  # K spans several 128-wide slices
    x = torch.randn(32, 1536, generator=g)
    panels = avx512.pack(w)
    full = avx512.linear(x, panels, 200)
    perm = torch.randperm(32, generator=g)
    assert torch.equal(avx512.linear(x[perm], panels, 200), full[perm])
    for i in (0, 7, 8, 31):
        assert torch.equal(avx512.linear(x[i:i + 1], panels, 200)[0], full[i])
    assert torch.equal(avx512.linear(x[3:20], panels, 200), full[3:20])


def test_non_contiguous_input_and_empty_batch():
    w, x = torch.randn(40, 64), torch.randn(64, 6)
    panels = avx512.pack(w)
    torch.testing.assert_close(avx512.linear(x.T, panels, 40), _reference(x.T, w))
    wide = torch.randn(11, 100)  # rows read in place at their stride: the same bits as a copy
    assert torch.equal(avx512.linear(wide[:, 3:67], panels, 40), avx512.linear(wide[:, 3:67].contiguous(), panels, 40))
    assert avx512.linear(torch.empty(0, 64), panels, 40).shape == (0, 40)


def test_bad_shapes_are_refused():
    panels = avx512.pack(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="x has 63 columns, the weight 64"):
        avx512.linear(torch.randn(2, 63), panels, 40)
    with pytest.raises(RuntimeError, match="n out of range"):
        avx512.linear(torch.randn(2, 64), panels, 65)


def test_linear_routes_by_rows():
    """Up to avx512.MAX_ROWS rows run on the panel kernel; more go to MKL's kernels."""
    w = torch.randn(96, 128)
    lin = Linear(w, pack=False, panels=True)
    small = torch.randn(avx512.MAX_ROWS, 128)
    assert torch.equal(lin(small), avx512.linear(small, lin.panels, 96))
    large = torch.randn(avx512.MAX_ROWS + 1, 128)
    assert torch.equal(lin(large), torch.nn.functional.linear(large, w))


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


@settings(max_examples=40, deadline=None)
@given(decodes=st.integers(1, 9), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 3, 4, 6, 8]),
       dim=st.sampled_from(avx512.HEAD_DIMS), width=st.integers(1, 70), seed=st.integers(0, 2**31 - 1))
def test_decode_attention_matches_float64(decodes, kv_heads, group, dim, width, seed):
    g = torch.Generator().manual_seed(seed)
    num_slots = decodes * width + 1
    k_cache, v_cache = torch.randn(num_slots, kv_heads, dim, generator=g), torch.randn(num_slots, kv_heads, dim, generator=g)
    # q as the model passes it: a strided view of the fused QKV rows (peaked softmaxes too)
    q = (torch.randn(decodes, kv_heads * group + 2, dim, generator=g) * 3)[:, 1:1 + kv_heads * group]
    lengths = torch.randint(1, width + 1, (decodes,), generator=g)
    lengths[0] = width
    slots = torch.randperm(num_slots, generator=g)[: decodes * width].view(decodes, width)
    out = avx512.decode_attention(q, k_cache, v_cache, slots, lengths, dim ** -0.5)
    torch.testing.assert_close(out, _sdpa_reference(q, k_cache, v_cache, slots, lengths), rtol=1e-5, atol=1e-5)
    into = torch.full((decodes + 1, *q.shape[1:]), float("nan"))
    assert avx512.decode_attention(q, k_cache, v_cache, slots, lengths, dim ** -0.5, out=into[1:]) is not None
    assert torch.equal(into[1:], out) and into[0].isnan().all()


def test_decode_attention_ignores_padding_and_refuses_bad_slots():
    k_cache, v_cache = torch.randn(10, 1, 64), torch.randn(10, 1, 64)
    q = torch.randn(2, 2, 64)
    slots = torch.tensor([[3, 4, 5], [7, 9, 9]])  # row 1 is padded past its length
    lengths = torch.tensor([3, 1])
    out = avx512.decode_attention(q, k_cache, v_cache, slots, lengths, 0.125)
    torch.testing.assert_close(out[1], v_cache[7].expand(2, 64))  # one key: the softmax is 1
    k_cache[9] = float("nan")  # what padding points at must never be read
    assert torch.equal(avx512.decode_attention(q, k_cache, v_cache, slots, lengths, 0.125), out)
    with pytest.raises(RuntimeError, match="slot out of range"):
        avx512.decode_attention(q, k_cache, v_cache, torch.tensor([[3, 4, 10], [7, 9, 9]]), lengths, 0.125)
    with pytest.raises(RuntimeError, match="length out of range"):
        avx512.decode_attention(q, k_cache, v_cache, slots, torch.tensor([4, 1]), 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        avx512.decode_attention(torch.randn(2, 2, 32), torch.randn(10, 1, 32), torch.randn(10, 1, 32), slots, lengths, 1.0)


def test_store_kv_is_index_copy():
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(20, 3, 64, generator=g), torch.randn(20, 3, 64, generator=g)
    qkv = torch.randn(5, 15, 64, generator=g)  # 9 query heads, then K and V: strided rows
    k, v = qkv[:, 9:12], qkv[:, 12:]
    slots = torch.tensor([7, 0, 19, 3, 8])
    want_k, want_v = k_cache.clone().index_copy_(0, slots, k), v_cache.clone().index_copy_(0, slots, v)
    avx512.store_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        avx512.store_kv(k_cache, v_cache, torch.tensor([7, 0, 20, 3, 8]), k, v)
    assert torch.equal(k_cache, want_k)  # refused before anything was written
    with pytest.raises(RuntimeError, match="slot_mapping must be"):
        avx512.store_kv(k_cache, v_cache, slots[:4], k, v)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), cols=st.integers(1, 700), seed=st.integers(0, 2**31 - 1))
def test_add_rms_norm_matches_the_formula(rows, cols, seed):
    from charioteer.model.llama import rms_norm

    g = torch.Generator().manual_seed(seed)
    x, delta, w = torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g), torch.randn(cols, generator=g)
    expected_x = x + delta
    h = avx512.add_rms_norm_(x, delta, w, 1e-5)
    assert torch.equal(x, expected_x)  # the residual add is exact and in place
    torch.testing.assert_close(h, rms_norm(expected_x, w, 1e-5), rtol=1e-5, atol=1e-6)


def test_rope_is_bitwise_the_formula():
    from charioteer.model.llama import apply_rope

    g = torch.Generator().manual_seed(1)
    for dim in (64, 128):
        qkv = torch.randn(13, 7 * dim, generator=g)
        qk = qkv[:, : 5 * dim].view(13, 5, dim)  # strided rows, as sliced from the fused projection
        cos, sin = torch.randn(13, dim, generator=g), torch.randn(13, dim, generator=g)
        assert torch.equal(avx512.rope(qk, cos, sin), apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1)))


def test_silu_mul_matches_torch():
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(9, 2 * 1000, generator=g) * 8  # reaches far into both tails of the sigmoid
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(avx512.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_argmax_rows_is_torch_argmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 1000 + 7, generator=g)
    logits[1, 5] = logits[1, 900] = 50.0  # a tie: the first index wins
    logits[2, 1006] = 60.0  # in the tail past the last full vector
    logits[3, 10] = float("nan")  # NaN counts as the maximum
    logits[3, 20] = float("nan")
    logits[4] = float("-inf")
    logits[5, 77] = float("inf")
    assert torch.equal(avx512.argmax_rows(logits), logits.argmax(dim=-1))
    assert avx512.argmax_rows(torch.randn(0, 10)).shape == (0,)


def test_greedy_takes_any_layout():
    from charioteer.engine.model_runner import greedy

    logits = torch.randn(50, 7)
    assert torch.equal(greedy(logits.T), logits.T.argmax(dim=-1))  # strided rows: torch's argmax
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))


_GENERATE = """
import json
from charioteer import LLM, SamplingParams
from charioteer.model import avx512
llm = LLM("synthetic:tiny,layers=2,heads=2,kv_heads=1", max_num_seqs=4, chunk_size=16)  # head_dim 64, GQA
outs = llm.generate([list(range(1, n)) for n in (9, 40, 70)], SamplingParams(max_tokens=12, temperature=0, logprobs=1))
print(json.dumps({"kernels": avx512.available(), "tokens": [o.outputs[0].token_ids for o in outs],
                  "logprobs": [[max(lp.values()) for lp in o.outputs[0].logprobs] for o in outs]}))
"""


def test_without_the_kernels_the_model_falls_back_to_the_same_outputs():
    """CHARIOTEER_AVX512=0 (as on a CPU without AVX-512 or a compiler): MKL and SDPA run, same greedy tokens."""
    import json
    import os
    import subprocess
    import sys

    def run(env_value: str) -> dict:
        env = dict(os.environ, CHARIOTEER_AVX512=env_value)
        out = subprocess.run([sys.executable, "-c", _GENERATE], capture_output=True, text=True, env=env, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    fused, fallback = run("1"), run("0")
    assert fused["kernels"] and not fallback["kernels"]
    assert fused["tokens"] == fallback["tokens"]
    for a, b in zip(fused["logprobs"], fallback["logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)
