"""The fused forms of the model's element-wise ops give the same bits as the textbook formulas."""
import torch

from charioteer.model.llama import apply_rope, rms_norm


def test_rms_norm_is_bitwise_the_formula():
    torch.manual_seed(0)
    for rows in (1, 16, 300):
        x, w = torch.randn(rows, 576) * 3, torch.randn(576)
        expected = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        assert torch.equal(rms_norm(x, w, 1e-5), expected)


def test_apply_rope_is_bitwise_the_rotate_half_formula():
    torch.manual_seed(0)
    dim, half = 64, 32
    angles = torch.randn(40, dim)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    x = torch.randn(40, 12, dim)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    assert torch.equal(apply_rope(x, cos, signed_sin), x * cos + rotated * sin)
    # On a strided view (Q and K inside the fused projection), as the model calls it.
    fused = torch.randn(40, 12 * dim + 3 * dim)
    view = fused[:, :12 * dim].view(40, 12, dim)
    assert torch.equal(apply_rope(view, cos, signed_sin), apply_rope(view.contiguous(), cos, signed_sin))
