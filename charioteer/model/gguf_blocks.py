"""A GGUF file's own quantized weights, kept in its blocks (`quantization="gguf"`).

GGUF stores a weight row by row in blocks. These kinds run here without an fp32 copy, each as blocks of 32
values in one of the GGUF kernel's forms (kernels/gguf_gemm.cpp): 4-bit q with a scale d and an offset m
(w = d q + m), 5-bit q, signed with a scale d (w = d q) or unsigned with d and m, or 8-bit signed q with a
scale d (and in the mixed form an m, both per 16 values), d and m in fp16 or fp32 as the kind needs:
- Q4_1 (20 bytes a block of 32: 0.625 bytes a weight): fp16 d and m, then 16 bytes of 4-bit q, value j in
  the low nibble of byte j and value 16 + j in its high nibble; w = d * q + m.
- Q8_0 (34 bytes): fp16 d, then 32 int8 q; w = d * q.
- Q4_0 (18 bytes): fp16 d, then q as Q4_1's; w = d * (q - 8): run as d and m = -8 d in fp32.
- Q5_0 (22 bytes): fp16 d, 32 fifth bits (a uint32, bit j for value j), then q's low 4 bits as Q4_1's;
  w = d * (q - 16): run as 5-bit q - 16 where the AVX-512 build runs (five_bit_records), else as int8.
- Q5_1 (24 bytes): fp16 d and m, then the fifth bits and low bits as Q5_0's; w = d * q + m: run as 5-bit q
  with d and m in fp32 (a record of fp16 d and m would be the size of the 4-bit fp32 one).
- IQ4_NL (18 bytes): fp16 d, then 4-bit indices as Q4_1's q into a table of 16 int8 values; w = d * table[q]:
  run as int8 table[q] with d.
- Q4_K (144 bytes a super-block of 256): fp16 d and dmin, eight 6-bit scales sc and mins mn packed in 12
  bytes, then 128 bytes of 4-bit q (values 64g + j and 64g + 32 + j in byte 32g + j's low and high nibble);
  value i has w = d sc_s q - dmin mn_s for its sub-block s = i / 32: run as d sc_s and m = -dmin mn_s in fp32.
- Q5_K (176 bytes a super-block of 256): Q4_K's d, dmin and scales, 32 bytes of fifth bits (bit g of byte j
  for value 32g + j), then the low bits as Q4_K's q; w = d sc_s q - dmin mn_s: run as Q5_1.
- Q6_K (210 bytes a super-block of 256): 128 bytes of q's low 4 bits, 64 of its high 2, 16 int8 scales sc, fp16
  d; value i has w = d sc_s (q - 32) for s = i / 16: run as int8 q - 32 with an fp32 d sc_s per 16 values.
- Q3_K (110 bytes a super-block of 256): 32 bytes of high bits, 64 of q's low 2 bits, sixteen 6-bit scales sc in
  12 bytes, fp16 d; w = d (sc_s - 32) (q - 4) for s = i / 16, q's high bit worth 4: run as Q6_K.
- IQ4_XS (136 bytes a super-block of 256): fp16 d, eight 6-bit scales ls (the high 2 bits of all in 2 bytes, the
  low 4 in the next 4), then IQ4_NL's indices per 32 values; w = d (ls_s - 32) table[q]: run as Q6_K, with
  the two d of a block of 32 equal.
- Q2_K (84 bytes a super-block of 256): sixteen bytes of a 4-bit scale sc (low nibble) and a 4-bit min mn (high
  nibble), 64 bytes of 2-bit q, fp16 d and dmin; w = d sc_s q - dmin mn_s for s = i / 16: run in the mixed form
  (int8 q with an fp32 d and m per 16 values).
- The lattice kinds IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S (50 to 110 bytes a super-block of
  256): each 8 or 4 values an index into a codebook of small integers (with signs, and IQ1's shift of 1/8), and a
  scale per 16 or 32 values from an fp16 d and a few bits; every value is an integer of at most 62 times its
  scale (1/8 of it for IQ1). gguf-py's dequantize gives the values (its codebooks), the scale comes from the
  block's bytes, and their quotient is the int8 q: run as Q6_K, checked exact when read.
Each form's values are exactly the file's (the products d sc_s, dmin mn_s, 8 d and d (ls - 32) are exact in
fp32), so `dequantize` gives the loader's fp32 weight. Q4_0 and Q4_K with fp32 scales read 0.75 bytes a weight
(the file: 0.56), Q5_1 and Q5_K 0.88 (0.75, 0.69), Q6_K 1.13 (0.82), Q3_K 1.13 (0.43), IQ4_NL 1.06 (0.56), IQ4_XS
1.25 (0.53), Q2_K 1.5 (0.33); Q5_0 its own 0.69, or 1.06 as int8 in a weight fused with Q8_0 parts. The default
model's file holds its linear layers in Q4_1 and its embedding (the tied LM head) in Q8_0; llama.cpp's Q4_K_M of it is
mostly Q5_0 and Q8_0 (its 576 columns are no multiple of 256), with Q4_K and Q6_K down projections, its Q5_K_M
mostly Q5_1, its IQ4_XS mostly IQ4_NL. The lattice kinds read 1.25 bytes a weight (their files 0.20 to 0.43).
Other kinds (F16, BF16, the ternary TQ kinds) run dequantized, as the model's dtype does.
`pack` regroups a weight for cpu_kernels.gguf_linear.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from charioteer.runtime import binary_switch

BLOCK = 32  # values per block of the kernel's forms, and per Q4_K sub-block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "IQ4_NL": 18, "Q3_K": 110, "Q4_K": 144,
               "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136, "Q2_K": 84}  # bytes a file block
LATTICE_BYTES = {"IQ1_S": 50, "IQ1_M": 56, "IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82, "IQ3_XXS": 98, "IQ3_S": 110}
BLOCK_BYTES.update(LATTICE_BYTES)
SMALL_BLOCKS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")  # blocks of 32 values; the others' hold 256
BLOCK_VALUES = {kind: BLOCK if kind in SMALL_BLOCKS else 256 for kind in BLOCK_BYTES}
KINDS = tuple(BLOCK_BYTES)
MIXED_FORM = (8, True, torch.float32, 2)  # int8 q, a d and an m per 16 values: any kind's, exactly
FORMS = {"Q4_0": (4, True, torch.float32, 1), "Q4_1": (4, True, torch.float16, 1),
         "Q5_0": (5, False, torch.float16, 1), "Q5_1": (5, True, torch.float32, 1),
         "Q8_0": (8, False, torch.float16, 1), "IQ4_NL": (8, False, torch.float16, 1),
         "Q3_K": (8, False, torch.float32, 2), "Q4_K": (4, True, torch.float32, 1),
         "Q5_K": (5, True, torch.float32, 1), "Q6_K": (8, False, torch.float32, 2),
         "IQ4_XS": (8, False, torch.float32, 2), "Q2_K": MIXED_FORM,
         **{kind: (8, False, torch.float32, 2) for kind in LATTICE_BYTES}}  # BlockWeight.form by kind
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
PANEL = 32  # output columns per packed panel

Fields = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor]
Form = tuple[int, bool, torch.dtype, int]


def _fields(raw: np.ndarray, group: int, bits: int) -> np.ndarray:
    """Bytes [..., n] of `bits`-wide fields (4: nibbles, 2: bit pairs, 1: bits) -> values [..., 8n / bits]: per
    `group` bytes, their lowest fields, then their next, up to their highest."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(-1, 1)
    fields = raw.reshape(*raw.shape[:-1], -1, 1, group) >> shifts
    return (fields & (1 << bits) - 1).reshape(*raw.shape[:-1], -1)


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of Q4_K's 12 bytes [..., 12]: sub-blocks 0-3 in the low 6 bits of bytes 0-3
    (scales) and 4-7 (mins); 4-7 in bytes 8-11's nibbles, with their top 2 bits in bytes 0-7's."""
    d, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


def _fp16(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[..., at:at + 2].copy().view(np.float16)[..., 0]


def _scale(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 scale at byte `at` in fp32, [..., 1]: to multiply a super-block's per-sub-block factors."""
    return _fp16(raw, at).astype(np.float32)[..., None]


# Each kind's blocks [rows, blocks, bytes] -> its d, m (or None) and q in a kernel form, as numpy arrays of the
# values in order (GGUFWeight.fields shapes them).
def _q8_0(raw: np.ndarray) -> tuple:
    return _fp16(raw, 0), None, raw[..., 2:].copy().view(np.int8)


def _q4_1(raw: np.ndarray) -> tuple:
    return _fp16(raw, 0), _fp16(raw, 2), _fields(raw[..., 4:], 16, 4)


def _q4_0(raw: np.ndarray) -> tuple:
    d = _fp16(raw, 0).astype(np.float32)
    return d, -8 * d, _fields(raw[..., 2:], 16, 4)


def _q5_0(raw: np.ndarray) -> tuple:
    """The fifth bits: a uint32, bit j for value j; then the low 4 bits as Q4_1's q."""
    return _fp16(raw, 0), None, (_fields(raw[..., 6:], 16, 4) | _fields(raw[..., 2:6], 1, 1) << 4).astype(np.int8) - 16


def _q5_1(raw: np.ndarray) -> tuple:
    q = _fields(raw[..., 8:], 16, 4) | _fields(raw[..., 4:8], 1, 1) << 4  # as Q5_0's
    return _fp16(raw, 0).astype(np.float32), _fp16(raw, 2).astype(np.float32), q


def _iq4_nl(raw: np.ndarray) -> tuple:
    return _fp16(raw, 0), None, IQ4_VALUES[_fields(raw[..., 2:], 16, 4)]


def _k_scales_and_mins(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's per sub-block d sc_s and m = -dmin mn_s (exact fp32 products) from their first 16 bytes."""
    scales, mins = _q4_k_scales(raw[..., 4:16])
    d = _scale(raw, 0) * scales.astype(np.float32)
    return d, -(_scale(raw, 2) * mins.astype(np.float32))


def _q4_k(raw: np.ndarray) -> tuple:
    return *_k_scales_and_mins(raw), _fields(raw[..., 16:], 32, 4)


def _q5_k(raw: np.ndarray) -> tuple:
    return *_k_scales_and_mins(raw), _fields(raw[..., 48:], 32, 4) | (_fields(raw[..., 16:48], 32, 1) << 4)


def _q6_k(raw: np.ndarray) -> tuple:
    """Values 0-127 and 128-255 of a super-block each from 64 bytes of low nibbles (the 64 low, then the 64 high)
    and 32 bytes of high bit pairs (bits 0-1, 2-3, 4-5, 6-7 for values 32 apart); a d per 16 values."""
    q = (_fields(raw[..., :128], 64, 4) | (_fields(raw[..., 128:192], 32, 2) << 4)).astype(np.int8) - 32
    return _scale(raw, 208) * raw[..., 192:208].view(np.int8), None, q


def _q3_k(raw: np.ndarray) -> tuple:
    """q's low bit pairs: bits 2s-2s+1 of byte 32g + j for value 128g + 32s + j; its high bit (worth 4):
    bit i of byte j for value 32i + j. Scale s's low 4 bits in byte s % 8's nibble s / 8, its top 2 bits in byte
    8 + s % 4's pair s / 4; sc - 32 scales 16 values."""
    q = _fields(raw[..., 32:96], 32, 2).astype(np.int8) - 4 * (1 - _fields(raw[..., :32], 32, 1).astype(np.int8))
    sc = (_fields(raw[..., 96:104], 8, 4) | _fields(raw[..., 104:108], 4, 2) << 4).astype(np.float32) - 32
    return _scale(raw, 108) * sc, None, q


def _iq4_xs(raw: np.ndarray) -> tuple:
    """Sub-block s's 6-bit ls: its low 4 bits in nibble s % 2 of byte 4 + s / 2, its top 2 in bits 2s-2s+1 of the
    uint16 at byte 2; then IQ4_NL's indices, 16 bytes a sub-block."""
    ls = (_fields(raw[..., 4:8], 1, 4) | _fields(raw[..., 2:4], 1, 2) << 4).astype(np.float32) - 32
    d = _scale(raw, 0) * ls
    return np.repeat(d, 2, axis=-1), None, IQ4_VALUES[_fields(raw[..., 8:], 16, 4)]


def _q2_k(raw: np.ndarray) -> tuple:
    """q's bit pairs: bits 2j-2j+1 of byte 32h + l for value 128h + 32j + l; byte s of the first 16 holds sub-block
    s's sc (low nibble) and mn (high); d sc_s and m = -dmin mn_s per 16 values (exact fp32 products)."""
    sc, mn = (raw[..., :16] & 0x0F).astype(np.float32), (raw[..., :16] >> 4).astype(np.float32)
    d, dmin = _scale(raw, 80), _scale(raw, 82)
    return d * sc, -(dmin * mn), _fields(raw[..., 16:80], 32, 2).astype(np.int8)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> their 2n nibbles, each byte's low one first."""
    return np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(*raw.shape[:-1], -1).astype(np.float32)


def _uint(raw: np.ndarray, dtype) -> np.ndarray:
    return raw.copy().view(dtype)


def _iq1_m_d(raw: np.ndarray) -> np.ndarray:
    """IQ1_M's fp16 d, its four nibbles the top nibbles of the four uint16 at byte 48."""
    top = _uint(raw[..., 48:56], np.uint16) >> 12
    return (top[..., 0] | top[..., 1] << 4 | top[..., 2] << 8 | top[..., 3] << 12).view(np.float16).astype(np.float32)


def _per_32(unit: np.ndarray) -> np.ndarray:
    """Scales per 32 values [..., n] as scales per 16 [..., 2n]."""
    return np.repeat(unit, 2, axis=-1)


# Each lattice kind's scale per 16 values [..., 16] from its super-blocks' bytes [..., bytes], as gguf-py scales
# (IQ1's divided by 8: its values are a codebook integer plus or minus 1/8).
_LATTICE_UNITS = {
    "IQ2_XXS": lambda r: _per_32(_scale(r, 0)
                                 * (0.5 + (_uint(r[..., 2:66], np.uint32)[..., 1::2] >> 28).astype(np.float32)) * 0.25),
    "IQ2_XS": lambda r: _scale(r, 0) * (0.5 + _nibbles(r[..., 66:74])) * 0.25,
    "IQ2_S": lambda r: _scale(r, 0) * (0.5 + _nibbles(r[..., 74:82])) * 0.25,
    "IQ3_XXS": lambda r: _per_32(_scale(r, 0)
                                 * (0.5 + (_uint(r[..., 66:98], np.uint32) >> 28).astype(np.float32)) * 0.5),
    "IQ3_S": lambda r: _per_32(_scale(r, 0) * (1 + 2 * _nibbles(r[..., 106:110]))),
    "IQ1_S": lambda r: _per_32(_scale(r, 0)
                               * (2 * ((_uint(r[..., 34:50], np.uint16) >> 12) & 7) + 1).astype(np.float32) / 8),
    "IQ1_M": lambda r: _iq1_m_d(r)[..., None] * (2 * ((_uint(r[..., 48:56], np.uint16)[..., None]
                                                       >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7)
                                                  .reshape(*r.shape[:-1], 16) + 1).astype(np.float32) / 8,
}


def _lattice(kind: str):
    def fields(raw: np.ndarray) -> tuple:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(raw.reshape(-1, raw.shape[-1]), GGMLQuantizationType[kind])
        w = values.reshape(*raw.shape[:-1], 16, 16)
        unit = _LATTICE_UNITS[kind](raw).astype(np.float32)[..., None]  # [..., 16, 1]
        q = np.round(np.divide(w, unit, out=np.zeros_like(w), where=unit != 0))
        if np.abs(q).max(initial=0) > 127 or not np.array_equal(q * unit, w):
            raise ValueError(f"{kind} blocks whose values are not int8 multiples of their scales")
        return unit[..., 0], None, q.astype(np.int8)
    return fields


_FIELDS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "IQ4_NL": _iq4_nl, "Q3_K": _q3_k,
           "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_XS": _iq4_xs,
           "Q2_K": _q2_k, **{kind: _lattice(kind) for kind in LATTICE_BYTES}}


def five_bit_records() -> bool:
    """Whether Q5_0 (signed 5-bit q, no offset) packs into its own 5-bit records: where the AVX-512 build runs,
    which applies the fifth bits with one masked subtract a vector (1.47x the int8 records from memory at one row
    on a Zen 4); the AVX2 build compares each lane's bit instead (0.85x there), so it reads int8 records.
    CHARIOTEER_GGUF_5BIT=1 or 0 forces either (both builds run both; the same bits)."""
    setting = os.environ.get("CHARIOTEER_GGUF_5BIT", "auto").strip().lower()
    if setting not in ("0", "1", "auto"):
        raise ValueError(f"CHARIOTEER_GGUF_5BIT={setting} is none of 0, 1, auto")
    if setting != "auto":
        return setting == "1"
    from charioteer.model import cpu_kernels

    return cpu_kernels.chosen_isa() == "avx512"


def int8_activation_records() -> bool:
    """Whether the 4-bit forms (Q4_1, Q4_0, Q4_K) pack for int8 activations: x quantized to int8 per block of 32,
    as llama.cpp quantizes it to Q8_1 for them, and multiplied four products a lane (kernels/gguf_gemm.cpp). On
    unless CHARIOTEER_GGUF_INT8_ACTIVATIONS=0, which keeps int16 activations: on a Zen 4 int8 ran 16 requests
    1.22-1.41x and workload B 1.20-1.27x faster, and its greedy tokens agree with fp32 on the same weights for
    0.78 of the test chats' tokens (int16: 1.00; int8 weights 0.78; llama.cpp on the same file 0.70-0.75;
    BENCHMARKS.md)."""
    return binary_switch("CHARIOTEER_GGUF_INT8_ACTIVATIONS", default=True)


def per_value(d: torch.Tensor) -> torch.Tensor:
    """Fields' d [rows, blocks] or [rows, blocks, sets] as each of the blocks' 32 values' scale [rows, blocks, 32]."""
    d = d.reshape(*d.shape[:2], -1, 1)
    return d.expand(*d.shape[:3], BLOCK // d.shape[2]).reshape(*d.shape[:2], BLOCK)


class BlockWeight:
    """What the model needs of a weight in blocks: its shape, its fields in a kernel form, and those packed."""

    @property
    def rows(self) -> int:
        raise NotImplementedError

    def fields(self) -> Fields:
        """d [rows, cols / 32] (fp16 or fp32; [rows, cols / 32, 2] with a d per 16 values), m (as d, [rows, cols /
        32, 2] in the mixed form; or None: the signed forms) and q [rows, cols / 32, 32] (uint8 0-15 with m in the
        4- and 5-bit forms, else int8)."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The weight in fp32 [rows, cols]: d * q (+ m), each in fp32."""
        d, m, q = self.fields()
        w = per_value(d.float()) * q.float()
        if m is not None:
            w = w + per_value(m.float())
        return w.reshape(self.rows, -1)

    def pack(self, five_bits: bool | None = None, int8_activations: bool | None = None) -> torch.Tensor:
        """uint8 [ceil(rows / 32), cols / 32, record] for cpu_kernels.gguf_linear: per panel of 32 output
        columns (rows past the last are zero) and k block, the columns' d (and m; or 5-bit q's fifth bits),
        then their q in 16-column halves, two k values (int8) or two nibble pairs (4- and 5-bit) side by side
        per column (kernels/gguf_gemm.cpp). `five_bits`: signed 5-bit q (Q5_0's) in their own records or as int8
        (None: five_bit_records()); unsigned ones, with an m, always in their own. `int8_activations` (the 4-bit
        forms; the others ignore it; None: int8_activation_records()): per column four k values as nibble pairs,
        for x quantized to int8, as [panels, cols / 32, record / 128, 128]."""
        pad = -self.rows % PANEL
        d, m, q = (None if t is None else torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in self.fields())
        panels, blocks = q.shape[0] // PANEL, q.shape[1]

        def columns(t: torch.Tensor) -> torch.Tensor:  # [rows, blocks, ...] -> [panels, blocks, 32 columns, ...]
            return t.reshape(panels, PANEL, blocks, *t.shape[2:]).transpose(1, 2)

        # per panel and block: each set of d (one per 16 k for two), then of m, the 32 columns' side by side
        scales = [columns(s.reshape(*s.shape[:2], -1)).transpose(2, 3).contiguous().view(torch.uint8)
                  .reshape(panels, blocks, -1) for s in (d, m) if s is not None]
        bits, offset = self.form[:2]
        if bits == 5 and not offset and not (five_bit_records() if five_bits is None else five_bits):
            bits = 8
        signed_five = bits == 5 and not offset  # q - 16 stored as q, the kernel subtracting 16 again
        quads = bits == 4 and (int8_activation_records() if int8_activations is None else int8_activations)
        q = columns((q + 16 if signed_five else q).view(torch.uint8))  # [panels, blocks, 32 columns, 32 k]
        if bits == 8:  # k = 2u + e -> [u][half][column][e]
            values = q.reshape(panels, blocks, 2, 16, 16, 2).permute(0, 1, 4, 2, 3, 5)
        elif quads:  # k = 8u + 4s + e, nibble s -> [u][column][e]
            q = q.reshape(panels, blocks, PANEL, 4, 2, 4)  # [column][u][s][e]
            values = (q[..., 0, :] | q[..., 1, :] << 4).permute(0, 1, 3, 2, 4)
            records = torch.cat(scales + [values.reshape(panels, blocks, -1)], dim=-1)
            return records.reshape(panels, blocks, -1, 128)  # 4-d: the kernel tells these records by it
        else:  # k = 4u + 2s + e, nibble s -> [u][half][column][e]
            q = q.reshape(panels, blocks, 2, 16, 8, 2, 2)  # [half][column][u][s][e]
            if bits == 5:  # per u, half and s, a word of the fifth bits of [column][e]
                fifth = (q >> 4).permute(0, 1, 4, 2, 5, 3, 6).reshape(panels, blocks, -1, 8)
                scales.append((fifth << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8))
                q = q & 0x0F
            values = (q[..., 0, :] | q[..., 1, :] << 4).permute(0, 1, 4, 2, 3, 5)
        return torch.cat(scales + [values.reshape(panels, blocks, -1)], dim=-1).contiguous()

    @property
    def form(self) -> Form:
        """(q's bits, an offset m, the scales' dtype, sets of d per block of 32): the kernel record it packs into."""
        raise NotImplementedError


@dataclass(frozen=True)
class GGUFWeight(BlockWeight):
    """One weight [rows, cols] as the file's bytes: uint8 [rows, cols / values * block bytes] of `kind` blocks."""

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
        return self.data.shape[1] // BLOCK_BYTES[self.kind] * BLOCK_VALUES[self.kind]

    @property
    def form(self) -> Form:
        return FORMS[self.kind]

    def fields(self) -> Fields:
        raw = self.data.numpy().reshape(self.rows, -1, BLOCK_BYTES[self.kind])
        d, m, q = _FIELDS[self.kind](raw)
        blocks = q.size // (self.rows * BLOCK)
        d, m = (None if t is None else torch.from_numpy(_per_block(t.reshape(self.rows, blocks, -1))) for t in (d, m))
        return d, m, torch.from_numpy(q.reshape(self.rows, -1, BLOCK))


def _per_block(t: np.ndarray) -> np.ndarray:
    """Scales [rows, blocks, sets] as [rows, blocks] where a block of 32 has one set, else as they are (one per 16)."""
    return t[..., 0] if t.shape[-1] == 1 else t


def _in_mixed_form(fields: Fields) -> Fields:
    """A weight's fields as MIXED_FORM's: d and m in fp32 twice a block where it has one set, m 0 where it has none."""
    d, m, q = fields
    m = torch.zeros_like(d) if m is None else m
    d, m = (t.float() if t.dim() == 3 else t.float()[..., None].expand(*t.shape, 2) for t in (d, m))
    return d, m, q.to(torch.int8)  # q of every kind fits int8


@dataclass(frozen=True)
class FusedWeight(BlockWeight):
    """Parts' rows stacked (a fused QKV or gate/up weight), whatever their kinds: in the parts' common kernel form
    (with the widest q: a Q5_0 part beside Q8_0 ones runs as int8), or in MIXED_FORM where they have none (a
    Q4_K Q and K beside a Q6_K V, as llama.cpp's Q4_K_M writes many layers)."""

    parts: tuple[GGUFWeight, ...]

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def form(self) -> Form:
        if len({p.form[1:] for p in self.parts}) > 1:
            return MIXED_FORM
        return max(p.form[0] for p in self.parts), *self.parts[0].form[1:]

    def fields(self) -> Fields:
        fields = [p.fields() for p in self.parts]
        if self.form == MIXED_FORM:
            fields = [_in_mixed_form(f) for f in fields]
        d, m, q = (torch.cat(f) if f[0] is not None else None for f in zip(*fields))
        return d, m, q


def concat(parts: list[GGUFWeight | None]) -> BlockWeight | None:
    """The parts' rows stacked (a fused QKV or gate/up weight), or None where a part is not in blocks or their
    columns differ."""
    if any(p is None for p in parts) or len({p.cols for p in parts}) != 1:
        return None
    return FusedWeight(tuple(parts))
