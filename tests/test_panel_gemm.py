"""The AVX-512 panel GEMM (charioteer/model/kernels/panel_gemm.cpp) against float64, and its batch invariance."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from charioteer.model import panel_gemm
from charioteer.model.llama import Linear

pytestmark = pytest.mark.skipif(not panel_gemm.available(), reason=f"panel GEMM: {panel_gemm.unavailable_reason()}")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 100), k=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_matches_float64(rows, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    y = panel_gemm.linear(x, panel_gemm.pack(w), n)
    assert y.shape == (rows, n)
    torch.testing.assert_close(y, _reference(x, w), rtol=1e-4, atol=1e-4 * k**0.5)


def test_rows_do_not_depend_on_the_batch():
    """Sums run over k in order per output, so a row's bits are the same alone, shuffled or in any batch."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 1536, generator=g)  # K spans several 128-wide slices
    x = torch.randn(32, 1536, generator=g)
    panels = panel_gemm.pack(w)
    full = panel_gemm.linear(x, panels, 200)
    perm = torch.randperm(32, generator=g)
    assert torch.equal(panel_gemm.linear(x[perm], panels, 200), full[perm])
    for i in (0, 7, 8, 31):
        assert torch.equal(panel_gemm.linear(x[i:i + 1], panels, 200)[0], full[i])
    assert torch.equal(panel_gemm.linear(x[3:20], panels, 200), full[3:20])


def test_non_contiguous_input_and_empty_batch():
    w, x = torch.randn(40, 64), torch.randn(64, 6)
    panels = panel_gemm.pack(w)
    torch.testing.assert_close(panel_gemm.linear(x.T, panels, 40), _reference(x.T, w))
    assert panel_gemm.linear(torch.empty(0, 64), panels, 40).shape == (0, 40)


def test_bad_shapes_are_refused():
    panels = panel_gemm.pack(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="x has 63 columns, the weight 64"):
        panel_gemm.linear(torch.randn(2, 63), panels, 40)
    with pytest.raises(RuntimeError, match="n out of range"):
        panel_gemm.linear(torch.randn(2, 64), panels, 65)


def test_linear_routes_by_rows():
    """Up to panel_gemm.MAX_ROWS rows run on the panel kernel; more go to MKL's kernels."""
    w = torch.randn(96, 128)
    lin = Linear(w, pack=False, panels=True)
    small = torch.randn(panel_gemm.MAX_ROWS, 128)
    assert torch.equal(lin(small), panel_gemm.linear(small, lin.panels, 96))
    large = torch.randn(panel_gemm.MAX_ROWS + 1, 128)
    assert torch.equal(lin(large), torch.nn.functional.linear(large, w))
