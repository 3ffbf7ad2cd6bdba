"""A GGUF file's own quantized weights, kept in its blocks (`quantization="gguf"`).

GGUF stores a weight row by row in blocks of 32 values. Two kinds run here without an fp32 copy:
- Q4_1 (20 bytes a block: 0.625 bytes a weight): fp16 d and m, then 16 bytes of 4-bit q, value j in
  the low nibble of byte j and value 16 + j in its high nibble; w = d * q + m.
- Q8_0 (34 bytes a block): fp16 d, then 32 int8 q; w = d * q.
The default model's file holds its linear layers in Q4_1 and its embedding (the tied LM head) in Q8_0.
`pack` regroups a weight for cpu_kernels.gguf_linear (the layout is described in kernels/gguf_gemm.cpp);
`dequantize` gives the fp32 weight the loader makes of the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # values per block
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
KINDS = tuple(BLOCK_BYTES)
PANEL = 32  # output columns per packed panel


@dataclass(frozen=True)
class GGUFWeight:
    """One weight [rows, cols] as the file's bytes: uint8 [rows, cols / 32 * block bytes] of `kind` blocks."""

    kind: str
    data: torch.Tensor

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"GGUF block kind {self.kind!r} is none of {', '.join(KINDS)}")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] % BLOCK_BYTES[self.kind]:
            raise ValueError(f"{self.kind} rows must be uint8 [rows, blocks * {BLOCK_BYTES[self.kind]}], "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def cols(self) -> int:
        return self.data.shape[1] // BLOCK_BYTES[self.kind] * BLOCK

    def _fields(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """d [rows, blocks] fp16, m (Q4_1, else None) and q [rows, blocks, 32] (uint8 0-15 or int8)."""
        raw = self.data.reshape(self.rows, -1, BLOCK_BYTES[self.kind])
        d = raw[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
        if self.kind == "Q8_0":
            return d, None, raw[..., 2:].contiguous().view(torch.int8)
        m = raw[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
        nibbles = raw[..., 4:]
        return d, m, torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)

    def dequantize(self) -> torch.Tensor:
        """The weight in fp32 [rows, cols]: d * q (+ m), each in fp32."""
        d, m, q = self._fields()
        w = d.float()[..., None] * q.float()
        if m is not None:
            w = w + m.float()[..., None]
        return w.reshape(self.rows, self.cols)

    def pack(self) -> torch.Tensor:
        """uint8 [ceil(rows / 32), cols / 32, record] for cpu_kernels.gguf_linear: per panel of 32 output
        columns (rows past the last are zero) and k block, the columns' fp16 d (and m), then their q in
        16-column halves, two k values (Q8_0) or two nibble pairs (Q4_1) side by side per column."""
        d, m, q = self._fields()
        pad = -self.rows % PANEL
        if pad:
            d, q = torch.nn.functional.pad(d, (0, 0, 0, pad)), torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad))
            m = None if m is None else torch.nn.functional.pad(m, (0, 0, 0, pad))
        panels, blocks = q.shape[0] // PANEL, q.shape[1]

        def columns(t: torch.Tensor) -> torch.Tensor:  # [rows, blocks, ...] -> [panels, blocks, 32 columns, ...]
            return t.reshape(panels, PANEL, blocks, *t.shape[2:]).transpose(1, 2)

        scales = [columns(s).contiguous().view(torch.uint8).reshape(panels, blocks, -1)
                  for s in (d, m) if s is not None]
        q = columns(q.view(torch.uint8))  # [panels, blocks, 32 columns, 32 k]
        if m is None:  # k = 2u + e -> [u][half][column][e]
            values = q.reshape(panels, blocks, 2, 16, 16, 2).permute(0, 1, 4, 2, 3, 5)
        else:  # k = 4u + 2s + e, nibble s -> [u][half][column][e]
            q = q.reshape(panels, blocks, PANEL, 8, 2, 2)
            values = (q[..., 0, :] | q[..., 1, :] << 4).reshape(panels, blocks, 2, 16, 8, 2).permute(0, 1, 4, 2, 3, 5)
        return torch.cat(scales + [values.reshape(panels, blocks, -1)], dim=-1).contiguous()


def concat(parts: list[GGUFWeight | None]) -> GGUFWeight | None:
    """The parts' rows stacked (a fused QKV or gate/up weight), or None unless all are of one kind."""
    if any(p is None for p in parts) or len({p.kind for p in parts}) != 1 or len({p.cols for p in parts}) != 1:
        return None
    return GGUFWeight(parts[0].kind, torch.cat([p.data for p in parts]))
