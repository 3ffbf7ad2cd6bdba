"""A LLaMA-family transformer over a flat batch of tokens.

The linear layers (fused QKV, O, fused gate/up, down) run once over every token of the batch.
Attention runs per request against its own KV cache: each prefill chunk attends causally to its
cached prefix and to itself (the paper's Figure 6); all decodes run as one call, on AVX-512 and AVX2
CPUs a kernel reading each context in place (charioteer.model.cpu_kernels), else SDPA. There a
decode-only batch runs every layer in one C++ call of the same kernels.

Which code runs is decided in two places: `Kernels.choose`, once per model, and `select_paths`,
once per batch (its docstring has the table).
"""
from __future__ import annotations

import bisect
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from charioteer.model import cpu_kernels, huge_pages, invariant
from charioteer.model.config import ModelConfig
from charioteer.model.gguf_blocks import KINDS, BlockWeight, GGUFWeight, concat, int8_activation_records
from charioteer.model.precision import (QUANTIZATIONS, bf16_compute, native_bf16_gemm, native_bf16_linear,
                                        onednn_fp32_gemm, onednn_linear, onednn_reorder, pack_native_bf16,
                                        quantize_int8)
from charioteer.runtime import binary_switch, switched_on, tune_allocator


@dataclass
class PrefillSpan:
    """One prompt chunk inside the flat batch."""

    offset: int  # first row of the chunk in the flat batch
    num_tokens: int
    start_pos: int  # position of its first token in the request
    context_slots: torch.Tensor | None  # KV slots of positions [0, start_pos + num_tokens); None if start_pos == 0
    mask: torch.Tensor | None  # [num_tokens, context] causal mask when start_pos > 0
    context_start: int | None = None  # first slot, when the context's slots are one contiguous run


@dataclass
class ForwardInput:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    prefills: list[PrefillSpan]
    num_decodes: int  # decode tokens are the last rows of the batch
    decode_slots: torch.Tensor | None  # [D, max_context] padded with the cache's zero slot
    logits_rows: torch.Tensor  # rows whose logits are wanted, in increasing order
    # (first slot, context length) of each decode, when every decode's slots are one contiguous run
    decode_runs: list[tuple[int, int]] | None = None
    decode_lengths: torch.Tensor | None = None  # [D] context length of each decode (int64, CPU), with decode_slots

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor | None:
        """[D, 1, 1, max_context]: which of decode_slots' columns are context, for SDPA. Made where a path
        asks (once a batch): the decode kernels read the lengths, and a step's every op costs when cold."""
        if self.decode_slots is None:
            return None
        lengths = self.decode_lengths.to(self.decode_slots.device)
        return (torch.arange(self.decode_slots.shape[1], device=lengths.device) < lengths[:, None])[:, None, None, :]


class KVCache:
    """K and V for every layer: [layers, 2, slots + 1, kv_heads, head_dim].

    The extra last slot stays zero; padded decode gathers point at it, so masked positions never
    multiply garbage (0 * NaN would poison the output).
    """

    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device, dtype=torch.float32,
                 num_layers: int | None = None) -> None:
        """`num_layers`: layers held here (a pipeline stage holds only its own); default all."""
        self.pad_slot = num_slots
        self.data = torch.empty(
            num_layers if num_layers is not None else config.num_layers, 2, num_slots + 1,
            config.num_kv_heads, config.head_dim, device=device, dtype=dtype,
        )
        self.data[:, :, self.pad_slot].zero_()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps): torch's fused kernel, bitwise equal to the op-by-op formula
    (tests/test_llama_ops.py). Below fp32 it normalizes in fp32 and rounds before the weight, as
    transformers' LlamaRMSNorm does."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1) written as roll(x) * (-1, 1).

    Negating sin instead of x gives the same bits, and rolling needs one op instead of two slices,
    a negation and a cat.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


# MKL's packed sgemm (the weight reordered once for its kernels) beats plain sgemm here for
# up to 64 rows: 2x at 8 rows, 1.3x at 16-64 (charioteer bench tile shows the curve); above 64
# rows it is no faster, so larger batches use F.linear on the original weight.
PACKED_GEMM_MAX_ROWS = 64
# Where fp32 GEMMs run oneDNN (precision.onednn_fp32_gemm: a CPU not Intel's), the AVX-512 panel kernel takes
# fp32 batches up to this many rows, not only cpu_kernels.max_rows()' 32: on SmolLM2's 30 layers from memory it
# beat oneDNN at 64 rows by 1.06x on a Zen 4 and 1.21x on a Zen 5 (32.6 [32.3, 33.0] against 39.3 [38.6, 39.9]
# ms), 1.04x at 128 on the Zen 5 (`charioteer bench roofline --model smollm2-135m --decode-stream --rows N`).
ONEDNN_PANEL_MAX_ROWS = 64


def packed_gemm_available(device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear") and switched_on("CHARIOTEER_PACKED_GEMM"))


DECODE_IN_PLACE_MIN_BYTES = 512 * 1024


class Linear:
    """y = x @ weight.T: the panel kernel up to `panel_rows` rows (Kernels.choose: cpu_kernels.max_rows(), 32 on
    AVX-512 and 128 on AVX2; ONEDNN_PANEL_MAX_ROWS beside oneDNN), MKL's packed GEMM up to 64, else F.linear;
    with `onednn` (precision.onednn_fp32_gemm), oneDNN on a once-reordered weight above the panel kernel
    instead of MKL.

    Each path is used only where it is available (see cpu_kernels and packed_gemm_available).
    `invariant`: a row's bits must not depend on the other rows (charioteer.model.invariant): the
    panel kernel for any number of rows, or without it one GEMM per row.
    """

    __slots__ = ("weight", "packed", "onednn", "panels", "panel_rows", "invariant")

    def __init__(self, weight: torch.Tensor, pack: bool, panel_rows: int = 0, invariant: bool = False,
                 onednn: bool = False) -> None:
        """`panel_rows`: run the panel kernel for batches of 1 to this many rows (0: never)."""
        if pack and onednn:
            raise ValueError("a Linear runs MKL's packed GEMM or oneDNN's above the panel kernel, not both")
        self.weight = weight
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACKED_GEMM_MAX_ROWS) if pack else None
        self.onednn = onednn_reorder(weight) if onednn else None
        self.panels = cpu_kernels.pack(weight) if panel_rows else None
        self.panel_rows = panel_rows
        self.invariant = invariant

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.invariant:
            if self.panels is not None:
                return cpu_kernels.linear(x, self.panels, self.weight.shape[0])
            return invariant.rowwise_linear(x, self.weight)
        if 0 < rows <= self.panel_rows:
            return cpu_kernels.linear(x, self.panels, self.weight.shape[0])
        if self.packed is not None and 0 < rows <= PACKED_GEMM_MAX_ROWS:
            return torch.ops.mkl._mkl_linear(x.contiguous(), self.packed, self.weight, None, rows)
        if self.onednn is not None and rows > 0:
            return onednn_linear(x, self.onednn)
        return F.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


# Up to how many times the fp32 panel kernel's row limit narrow weights (int8, or bf16 under fp32
# activations) stay in the panel kernel. Its alternative above the limit writes and reads an fp32
# copy of the weight first: on Zen 3 (AVX2), for int8, the panel kernel is 1.1-1.9x faster than
# that at 256 rows of SmolLM2's and the LM head's shapes, 0.96-1.3x at 512, and 0.6-1.0x at 1024;
# for bf16, 1.2-1.7x at 256 (also a LLaMA-7B gate/up), 0.9-1.25x at 512 and 1.05-1.15x at 1024
# (medians of 5). Not measured on AVX-512.
NARROW_PANEL_ROWS_FACTOR = 4
# Rows from which widened bf16 runs torch's bf16 GEMM where the CPU has one (AMX). On a Xeon with
# AMX, 2 threads, against the AVX-512 panel kernel (medians of 9): at 8 rows AMX is 1.34-1.39x
# faster on LLaMA-7B's QKV and gate/up and 0.74-0.80x on SmolLM2's gate/up and LM head; at 16
# rows 1.56-2.75x faster on all four; at 4 rows and fewer the panel kernel wins (1.04-2.8x).
NATIVE_BF16_MIN_ROWS = 8
# Where the CPU has AMX tiles (cpu_kernels.amx_available), widened bf16 runs cpu_kernels.amx_linear for
# 1 to this many rows, in place of both the panel kernel and oneDNN, and oneDNN's GEMM above. On a Xeon
# with AMX, 2 threads, weights out of cache, 9 interleaved pairs (oneDNN's time over the tile kernel's,
# median [min, max]): SmolLM2's 30 layers 1.44x [1.40, 1.72] at 1 row, 1.36x at 32, 1.22x at 64,
# 1.11x [0.89, 1.36] at 128, 0.91x at 192 and 0.95x at 256; one LLaMA-7B layer 1.17x at 1 row,
# 1.30-1.37x at 16-64, 1.24x [1.18, 2.30] at 128, 1.04x at 192 and 0.94x at 256.
AMX_MAX_ROWS = 128
# Where the CPU has AVX512-BF16 but no AMX tiles (Zen 4), widened bf16 runs cpu_kernels.avx512_bf16_linear for
# 1 to this many rows, in place of both the panel kernel and oneDNN, and oneDNN's GEMM above. On a Zen 4,
# 2 threads, weights out of cache, 5 interleaved rounds (oneDNN's time over this kernel's, median):
# SmolLM2's 30 layers 2.1x at 1 row, 1.45x at 8, 1.21x at 16, 1.09x at 32, 1.06x at 192, 1.04x at 256
# and 0.93x at 512; one LLaMA-7B layer 1.31x at 1, 1.09x at 8, 0.99x at 16, 1.07x at 32 and 1.00-1.03x
# from 64 to 256. Against the panel kernel on the weight widened to fp32, 1.04-1.19x at 1 to 4 rows.
AVX512_BF16_MAX_ROWS = 256
TILE_KERNELS = (None, "amx", "avx512_bf16")  # Kernels.tile_kernel: the bf16 kernels on amx_pack's layout


def tile_linear(kernel: str):
    """The function of a Kernels.tile_kernel: (x bf16, packed, n, bf16_output=) -> x @ w.T."""
    return {"amx": cpu_kernels.amx_linear, "avx512_bf16": cpu_kernels.avx512_bf16_linear}[kernel]


# Rows from which int8 weights run on a tile kernel (Kernels.int8_tile_kernel): AMX's int8 tiles (x
# quantized to int16 per row), or AVX512-BF16 (the panel widened to bf16, x rounded to bf16). Fewer stay on
# the panel kernel (int8 widened to fp32 in registers, fp32 x) or its VNNI form.
# Against the panel kernel, 2 threads, weights out of cache, interleaved rounds:
# - AMX tiles when they widened q to bf16 (the int8 tiles since took 8-16 rows 1.25x faster), a Xeon, 9
#   rounds: SmolLM2's 30 layers 0.79x at 1 row, 0.91x at 4, 1.17x at 8, 2.1x at 16, 2.6x at 32; a LLaMA-7B
#   layer 0.77x at 1, 1.02x at 4, 1.23x at 8, 2.4x at 16, 3.6x at 32. Below 8 rows the int8 tiles only match
#   vnni_linear_int8 (0.98-1.03x at 1-6 rows).
# - AVX512-BF16 (cpu_kernels.avx512_bf16_linear_int8), a Zen 4, 5 rounds (3 for LLaMA-7B): SmolLM2's 30
#   layers and LM head 0.51x at 1, 0.81x at 4, 1.01x at 8, 1.6x at 12-16, 1.8x at 64-256; a LLaMA-7B layer
#   0.50x at 1, 1.12x at 8, 1.75x at 10, 1.9x at 16, 2.0-2.1x at 64-256.
INT8_TILE_MIN_ROWS = 8


def tile_linear_int8(kernel: str):
    """The int8 GEMM of a Kernels.int8_tile_kernel: (x fp32, int8 panels, n, scale) -> x @ (q * scale).T."""
    return {"amx": cpu_kernels.amx_linear_int8, "avx512_bf16": cpu_kernels.avx512_bf16_linear_int8}[kernel]


def amx_attention_enabled(config: ModelConfig) -> bool:
    """Whether prompt chunks attend on AMX tiles (cpu_kernels.amx_prefill_attention) where the tile
    kernels run: for any head size the kernel runs (a multiple of 32 up to 128), unless
    CHARIOTEER_AMX_ATTENTION=0 keeps torch's SDPA (=1 and auto, the default, take the kernel). Against
    SDPA in bf16 on a Xeon with AMX, 2 threads (`charioteer bench roofline --attention --dtype bfloat16`):
    LLaMA-7B's chunks 1.6-2.7x faster, SmolLM2's 2.0-2.4x; two more head shapes in BENCHMARKS.md."""
    setting = os.environ.get("CHARIOTEER_AMX_ATTENTION", "auto").strip().lower()
    if setting not in ("0", "1", "auto"):
        raise ValueError(f"CHARIOTEER_AMX_ATTENTION={setting} is none of 0, 1, auto")
    return setting != "0" and config.head_dim % 32 == 0 and config.head_dim <= 128


def vector_attention_enabled() -> bool:
    """Whether prompt chunks may attend in cpu_kernels.prefill_attention (vectors) instead of torch's
    SDPA: CHARIOTEER_VECTOR_ATTENTION=1 (the default) or 0. Against SDPA on a 2-core Zen 4, SmolLM2's
    chunks of 37-512 at positions 0-896 ran 1.4-2.4x faster in fp32 and 2.0-4.0x in bf16 (bf16 products),
    a LLaMA-7B layer's (32 heads, dim 128) chunks of 17-256 0.95-1.7x and 1.1-2.5x (`charioteer bench
    roofline --attention`, BENCHMARKS.md)."""
    return binary_switch("CHARIOTEER_VECTOR_ATTENTION", default=True)


class NarrowLinear:
    """y = x @ w.T with w stored narrower than x and widened to fp32 in the panel kernel's registers,
    so a memory-bound call reads a quarter (int8) or half (bf16) of fp32's bytes; for more than
    NARROW_PANEL_ROWS_FACTOR * `panel_rows` rows the weight is widened once for one fp32 GEMM.
    `native_rows` (bf16 weights): from this many rows, x rounded to bf16 goes through oneDNN's bf16
    GEMM instead (AMX) on the weight packed for it, its product widened back (kept bf16 with
    `bf16_output`); fewer rows round as that GEMM does (0: never), on the panel kernel, or with
    a `tile_kernel` (Kernels.tile_kernel: `panels` then holds the weight in amx_pack's order)."""

    __slots__ = ("weight", "scale", "panels", "panel_rows", "native_rows", "bf16_output", "tile_linear")

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, panel_rows: int, native_rows: int = 0,
                 bf16_output: bool = False, tile_kernel: str | None = None) -> None:
        if native_rows and (weight.dtype != torch.bfloat16 or scale is not None):
            raise ValueError("only bf16 weights without scales run torch's bf16 GEMM")
        if tile_kernel and not native_rows:
            raise ValueError("the tile kernels run the rows below native_rows: give native_rows")
        self.tile_linear = tile_linear(tile_kernel) if tile_kernel else None  # looked up once, not per call
        self.panels = cpu_kernels.amx_pack(weight) if tile_kernel else cpu_kernels.pack(weight) if panel_rows else None
        self.weight = pack_native_bf16(weight) if native_rows else weight
        self.scale = scale
        self.panel_rows = panel_rows * NARROW_PANEL_ROWS_FACTOR
        self.native_rows = native_rows
        self.bf16_output = bf16_output and bool(native_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_rows:
            x = x.to(torch.bfloat16)
            if x.shape[0] >= self.native_rows:
                product = native_bf16_linear(x, self.weight)
            elif self.tile_linear:
                product = self.tile_linear(x, self.panels, self.weight.shape[0], bf16_output=True)
            else:
                # the panel kernel takes and gives what the bf16 GEMM does (bf16 input, product rounded
                # to bf16), so a row's result does not change with the number of rows in its batch
                # beyond the order of the fp32 sums
                product = cpu_kernels.linear(x.float(), self.panels, self.weight.shape[0]).to(torch.bfloat16)
            return product if self.bf16_output else product.float()
        if x.shape[0] <= self.panel_rows:
            return cpu_kernels.linear(x, self.panels, self.weight.shape[0], self.scale)
        weight = self.weight.float()
        return F.linear(x, weight if self.scale is None else weight * self.scale[:, None])

    @property
    def nbytes(self) -> int:
        scale_bytes = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.weight.numel() * self.weight.element_size() + scale_bytes


class Int8Linear(NarrowLinear):
    """y = x @ (q * scale[:, None]).T with q int8 (charioteer.model.precision.quantize_int8), in x's dtype.

    With the CPU kernels (fp32 activations, `panel_rows` > 0) it runs as a NarrowLinear: the panel
    kernel widens q in registers, or with `vnni` (Kernels.int8_vnni) cpu_kernels.vnni_linear_int8 takes
    those rows (x quantized to int16 per block of 128 values). With `tile_rows` and a `tile_kernel`
    (Kernels.int8_tile_kernel), a batch of that many rows or more runs that kernel on the same panels
    instead (AMX's int8 tiles with x quantized to int16 per row, or x rounded to bf16 and q widened to
    bf16 for AVX512-BF16). Without the kernels, torch's weight-only int8 GEMM runs, which on an AVX2
    CPU is 5-40x slower than the fp32 panel kernel on the same shape.
    """

    __slots__ = ("tile_rows", "tile_linear", "vnni")

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, panel_rows: int = 0, tile_rows: int = 0,
                 tile_kernel: str | None = None, vnni: bool = False) -> None:
        if bool(tile_rows) != bool(tile_kernel):
            raise ValueError("int8 on a tile kernel takes both the rows it starts at and the kernel")
        if (tile_rows or vnni) and not (panel_rows and dtype == torch.float32):
            raise ValueError("int8 on a tile kernel or VNNI reads the panels, with fp32 activations: give panel_rows")
        q, scale = quantize_int8(weight)
        super().__init__(q, scale.to(dtype), panel_rows)
        self.tile_rows = tile_rows
        self.tile_linear = tile_linear_int8(tile_kernel) if tile_kernel else None
        self.vnni = vnni

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_rows and x.shape[0] >= self.tile_rows:
            return self.tile_linear(x, self.panels, self.weight.shape[0], self.scale)
        if self.panels is None:
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.weight, self.scale)
        if self.vnni and x.shape[0] <= self.panel_rows:
            return cpu_kernels.vnni_linear_int8(x, self.panels, self.weight.shape[0], self.scale)
        return super().__call__(x)


class GGUFLinear:
    """y = x @ W.T for W in a GGUF file's own blocks (gguf_blocks.BlockWeight), repacked once for
    cpu_kernels.gguf_linear, with no fp32 copy: each row of x quantized to int16 per block of 32 values (with
    `int8_activations`, to int8 for the 4-bit forms, as llama.cpp does), the products summed exactly per block.
    fp32 in and out; x in another dtype is widened and the product rounded back to it."""

    __slots__ = ("panels", "n", "vnni")

    def __init__(self, weight: BlockWeight, vnni: bool = False, int8_activations: bool = False) -> None:
        """`vnni`: the sums with AVX512-VNNI (Kernels.gguf_vnni), the same bits. `int8_activations`:
        Kernels.gguf_int8_activations."""
        self.panels = weight.pack(int8_activations=int8_activations)
        self.n = weight.rows
        self.vnni = vnni

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_kernels.gguf_linear(x.float(), self.panels, self.n, vnni=self.vnni)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.panels.numel()


class TorchRowOps:
    """A layer's element-wise steps as torch ops."""

    @staticmethod
    def residual(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def rope(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(qk, cos.unsqueeze(1), signed_sin.unsqueeze(1))

    @staticmethod
    def add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, bf16: bool = False):
        """(x + delta, its RMSNorm), the norm rounded to bf16 with `bf16`."""
        x = x + delta
        h = rms_norm(x, weight, eps)
        return x, h.bfloat16() if bf16 else h

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, v)


class NativeRowOps:
    """The same steps, one CPU kernel call each (tests/test_cpu_kernels.py compares them with the torch ops)."""

    @staticmethod
    def residual(x: torch.Tensor) -> torch.Tensor:
        return x.clone()  # add_norm updates it in place; the caller's tensor stays as it was

    @staticmethod
    def add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, bf16: bool = False):
        return x, cpu_kernels.add_rms_norm_(x, delta, weight, eps, bf16_out=bf16)

    rope = staticmethod(cpu_kernels.rope)
    silu_mul = staticmethod(cpu_kernels.silu_mul)
    store_kv = staticmethod(cpu_kernels.store_kv)


def bf16_runs_widened(device: torch.device) -> bool:
    """Whether bf16 runs widened on `device`: bf16 weights and KV cache, fp32 arithmetic in the CPU
    kernels (charioteer.model.precision.bf16_compute), where they run here."""
    return device.type == "cpu" and cpu_kernels.available() and bf16_compute(device) == "widened"


@dataclass(frozen=True)
class Kernels:
    """The optional kernels one model runs, fixed at its construction by `choose`."""

    panel_rows: int  # Linear and decode_layers: the panel GEMM for 1 to this many rows (0: none)
    packed_gemm: bool  # Linear: MKL's packed sgemm for 1 to PACKED_GEMM_MAX_ROWS rows
    row_ops: bool  # NativeRowOps instead of TorchRowOps
    decode_attention: bool  # cpu_kernels.decode_attention for a batch's decodes
    decode_layers: bool  # a decode-only batch's every layer in one C++ call of the kernels above
    invariant: str | None = None  # batch-invariant mode's path ("native" or "portable"), else None
    widened_bf16: bool = False  # bf16 weights and KV cache widened to fp32 activations in the kernels
    native_bf16_rows: int = 0  # widened bf16: torch's bf16 GEMM (AMX) from this many rows, and bf16 prefill attention (0: neither)
    # with native_bf16_rows: the weights in amx_pack's order, and the rows below them on cpu_kernels.amx_linear
    # ("amx") or cpu_kernels.avx512_bf16_linear ("avx512_bf16") instead of the panel kernel (None); with
    # "avx512_bf16", vector_attention's products are bf16 too
    tile_kernel: str | None = None
    amx_attention: bool = False  # with native_bf16_rows: prompt chunks attend on AMX tiles, not torch's SDPA
    int8_tile_rows: int = 0  # int8 weights: int8_tile_kernel from this many rows (0: never)
    int8_tile_kernel: str | None = None  # its int8 GEMM ("amx" or "avx512_bf16", tile_linear_int8)
    int8_vnni: bool = False  # int8 weights: cpu_kernels.vnni_linear_int8 for the panel kernel's rows
    onednn_fp32: bool = False  # Linear: oneDNN on reordered fp32 weights above the panel rows, for MKL
    vector_attention: bool = False  # prompt chunks attend in cpu_kernels.prefill_attention, not torch's SDPA
    gguf: bool = False  # quantization="gguf": a GGUF file's own blocks on cpu_kernels.gguf_linear (GGUFLinear)
    gguf_vnni: bool = False  # gguf: its sums with AVX512-VNNI's vpdpwssd (cpu_kernels.vnni_unavailable_reason)
    # gguf: the 4-bit forms' activations quantized to int8, as llama.cpp's (gguf_blocks.int8_activation_records)
    gguf_int8_activations: bool = False

    def __post_init__(self) -> None:
        if self.decode_layers and not (self.row_ops and self.decode_attention):
            raise ValueError("decode_layers runs the native row ops and decode attention: it needs both")
        if self.widened_bf16 and not (self.panel_rows and self.row_ops and self.decode_attention):
            raise ValueError("widened bf16 runs the panel GEMM, the native row ops and decode attention: it needs all")
        if self.native_bf16_rows and not self.widened_bf16:
            raise ValueError("native_bf16_rows applies to widened bf16 only")
        if self.tile_kernel not in TILE_KERNELS:
            raise ValueError(f"tile_kernel {self.tile_kernel!r} is none of {TILE_KERNELS}")
        if self.tile_kernel and not self.native_bf16_rows:
            raise ValueError("tile_kernel runs the rows below native_bf16_rows: it needs them")
        if self.amx_attention and not self.native_bf16_rows:
            raise ValueError("amx_attention attends on the bf16 cache in bf16: it needs native_bf16_rows")
        if self.int8_tile_kernel not in TILE_KERNELS or bool(self.int8_tile_rows) != bool(self.int8_tile_kernel):
            raise ValueError(f"int8_tile_kernel {self.int8_tile_kernel!r} must be one of {TILE_KERNELS[1:]}, "
                             "given with int8_tile_rows, or None without them")
        if (self.int8_tile_rows or self.int8_vnni) and not self.panel_rows:
            raise ValueError("int8_tile_rows and int8_vnni run int8 weights from the panel kernel's panels: "
                             "they need them")
        if (self.gguf_vnni or self.gguf_int8_activations) and not self.gguf:
            raise ValueError("gguf_vnni and gguf_int8_activations run the GGUF kernel: they need gguf")
        if self.vector_attention and self.amx_attention:
            raise ValueError("prompt chunks attend on AMX tiles or in the vector kernel, not both")
        if self.onednn_fp32 and (self.packed_gemm or self.invariant):
            raise ValueError("onednn_fp32 replaces MKL's GEMMs outside the batch-invariant mode: not with "
                             "packed_gemm or invariant")

    @classmethod
    def choose(cls, config: ModelConfig, device: torch.device, dtype: torch.dtype = torch.float32,
               quantized: bool = False, batch_invariant: bool = False, gguf: bool = False) -> Kernels:
        """The CPU kernels where this CPU runs them (cpu_kernels.available: AVX-512 or AVX2, unless
        CHARIOTEER_CPU_KERNELS says otherwise), each where the head size suits it; MKL's packed GEMM where torch
        has it, unless CHARIOTEER_PACKED_GEMM=0, or oneDNN's in place of MKL's GEMMs where precision.onednn_fp32_gemm
        prefers it (a CPU not Intel's; the panel GEMM then takes fp32 batches up to ONEDNN_PANEL_MAX_ROWS). All of
        them take fp32 activations only; the panel GEMM also takes int8 and bf16 weights (NarrowLinear), MKL's not.

        bf16 runs widened (`widened_bf16`: bf16 weights and KV cache, fp32 activations, all in the
        kernels) where they run (`bf16_runs_widened`) and the head size suits them, else torch's bf16
        ops; where the CPU computes bf16 (AMX, AVX512-BF16), widened bf16 takes torch's bf16 GEMM from
        NATIVE_BF16_MIN_ROWS rows and attends prompts in bf16 (`native_bf16_rows`); where it has AMX tiles
        (cpu_kernels.amx_available) the tile kernel takes 1 to AMX_MAX_ROWS rows and torch's GEMM the rest,
        else where it has AVX512-BF16 (cpu_kernels.avx512_bf16_unavailable_reason) its kernel 1 to
        AVX512_BF16_MAX_ROWS.
        int8 weights (fp32 activations) run batches of INT8_TILE_MIN_ROWS rows or more (`int8_tile_rows`) on
        AMX tiles where the CPU has them, else with AVX512-BF16 where it has that
        (cpu_kernels.int8_tile_kernel), fewer on the panel kernel, or with AVX512-VNNI on
        cpu_kernels.vnni_linear_int8 (`int8_vnni`, cpu_kernels.vnni_unavailable_reason).
        Prompt chunks attend in the vector kernel (`vector_attention`, vector_attention_enabled) in fp32,
        int8 and widened bf16, except where AMX tiles compute bf16. `gguf`: a GGUF file's blocks on
        cpu_kernels.gguf_linear where it runs, with VNNI where int8 would. `batch_invariant` (fp32, no
        quantization): every kernel but MKL's on the native path, none on the portable one (invariant.choose_path)."""
        if batch_invariant:
            if dtype != torch.float32 or quantized or gguf:
                raise ValueError("the batch-invariant mode runs fp32 weights only, without quantization")
            native = invariant.choose_path(device, config.head_dim) == "native"
            return cls(panel_rows=cpu_kernels.max_rows() if native else 0, packed_gemm=False, row_ops=native,
                       decode_attention=native, decode_layers=native, invariant="native" if native else "portable")
        kernels = device.type == "cpu" and cpu_kernels.available()
        row_ops = kernels and config.head_dim % 32 == 0
        decode_attention = kernels and config.head_dim in cpu_kernels.HEAD_DIMS
        widened = dtype == torch.bfloat16 and row_ops and decode_attention and bf16_runs_widened(device)
        native = kernels and (dtype == torch.float32 or widened)
        fp32 = dtype == torch.float32 and not quantized
        onednn = onednn_fp32_gemm(device) and fp32  # the switch's value is checked in every dtype
        panel_rows = max(cpu_kernels.max_rows(), ONEDNN_PANEL_MAX_ROWS if onednn else 0) if native else 0
        # bf16 in torch's ops (AMX) still attends its decodes in the kernel, in fp32 on the bf16 cache read in
        # place: torch's SDPA per decode reads it at a fifth of the bandwidth (0.75 ms per 256-token LLaMA-7B decode)
        torch_bf16 = kernels and dtype == torch.bfloat16 and not widened
        gguf_kernel = gguf and kernels and cpu_kernels.gguf_unavailable_reason() is None
        native_gemm = widened and not (quantized or gguf_kernel) and native_bf16_gemm(device)
        amx = native_gemm and cpu_kernels.amx_available()
        avx512_bf16 = native_gemm and not amx and cpu_kernels.avx512_bf16_unavailable_reason() is None
        tile_rows = AMX_MAX_ROWS if amx else AVX512_BF16_MAX_ROWS if avx512_bf16 else NATIVE_BF16_MIN_ROWS - 1
        int8_tiles = cpu_kernels.int8_tile_kernel() if quantized and native else None
        vnni = cpu_kernels.vnni_unavailable_reason() is None
        # fp32 or widened bf16; where AMX computes bf16, its tiles or SDPA in bf16 stay (_prefill_attention): the
        # vector kernel has not been measured against them on such a CPU
        vector = vector_attention_enabled() and native and decode_attention and not amx
        return cls(panel_rows=panel_rows, row_ops=native and row_ops,
                   decode_attention=(native or torch_bf16) and decode_attention,
                   packed_gemm=packed_gemm_available(device) and fp32 and not onednn, onednn_fp32=onednn,
                   decode_layers=native and row_ops and decode_attention, widened_bf16=widened,
                   native_bf16_rows=tile_rows + 1 if native_gemm else 0,
                   tile_kernel="amx" if amx else "avx512_bf16" if avx512_bf16 else None,
                   amx_attention=amx and amx_attention_enabled(config), vector_attention=vector,
                   int8_tile_rows=INT8_TILE_MIN_ROWS if int8_tiles else 0, int8_tile_kernel=int8_tiles,
                   int8_vnni=quantized and native and vnni, gguf=gguf_kernel, gguf_vnni=gguf_kernel and vnni,
                   gguf_int8_activations=gguf_kernel and int8_activation_records())

    def small_batch_rows(self, quantized: bool) -> int:
        """The most rows a linear layer runs on a small-batch path (the panel GEMM, MKL's packed GEMM);
        a larger batch runs one plain GEMM, at another cost per row (the simulator's step cost model
        prices the two apart: charioteer.sim.validate)."""
        if self.int8_tile_rows:
            return self.int8_tile_rows - 1
        if self.native_bf16_rows:
            return self.native_bf16_rows - 1
        panel = self.panel_rows * (NARROW_PANEL_ROWS_FACTOR if quantized or self.widened_bf16 else 1)
        return max(panel, PACKED_GEMM_MAX_ROWS if self.packed_gemm else 0)

    def widen_rows(self, quantized: bool) -> int:
        """With weights narrower than the activations (widened bf16, int8) on the panel GEMM: its row
        block. A batch of more rows widens each weight slice once before its row blocks use it; one
        block widens as it goes (0 for fp32 weights, which need no widening)."""
        if self.tile_kernel:  # the tile kernels read bf16 as it is
            return 0
        return cpu_kernels.row_block() if self.panel_rows and (quantized or self.widened_bf16) else 0

    def activation_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The activations' dtype for weights and KV cache in `dtype`."""
        return torch.float32 if self.widened_bf16 else dtype

    @property
    def ops(self) -> type[TorchRowOps] | type[NativeRowOps]:
        return NativeRowOps if self.row_ops else TorchRowOps


@dataclass(frozen=True)
class BatchPaths:
    decode_layers: bool  # every layer in one C++ call (LlamaModel.decode_layers)
    decode_attention: str | None  # "kernel", "in_place" or "gathered"; None when the batch has no decodes


def select_paths(kernels: Kernels, inp: ForwardInput, kv: KVCache, profiled: bool) -> BatchPaths:
    """The paths one batch takes through a model with `kernels`.

    path                        taken when
    --------------------------  -----------------------------------------------------------------
    decode_layers               kernels.decode_layers, a decode-only batch of 1 to kernels.panel_rows
                                rows with decode_lengths, not profiled (hooks time the loop's ops)
    decode_attention "kernel"   kernels.decode_attention and decode_lengths given
    decode_attention "in_place" else, each decode's context is one run of slots and reading it in
                                place pays (_in_place_decode_pays): SDPA per decode on cache rows
    decode_attention "gathered" else: one SDPA over the contexts gathered and padded, masked

    Within the layer loop, each prefill chunk attends to its own K/V when it has no cached prefix,
    else to its context's cache rows in place when they are one run, else to a gathered copy;
    `Linear` picks its GEMM by row count, and `kernels.ops` runs the element-wise steps.
    """
    has_lengths = inp.decode_lengths is not None
    decode_layers = (kernels.decode_layers and not profiled and not inp.prefills and has_lengths
                     and 0 < inp.num_decodes <= kernels.panel_rows)
    if not inp.num_decodes:
        decode_attention = None
    elif kernels.decode_attention and has_lengths:
        decode_attention = "kernel"
    elif _in_place_decode_pays(inp, kv):
        decode_attention = "in_place"
    else:
        decode_attention = "gathered"
    return BatchPaths(decode_layers, decode_attention)


def _in_place_decode_pays(inp: ForwardInput, kv: KVCache) -> bool:
    """Whether to attend each decode on its own contiguous cache rows instead of one batched call on
    a gathered copy.

    The batched call copies every context (padded to the longest) and reads the copy again; a
    call per decode reads the cache once but pays a call's overhead. Per decode from
    DECODE_IN_PLACE_MIN_BYTES of K and V per layer the copy costs more: LLaMA-7B's 230-token
    contexts are 7.5 MB each, SmolLM2's 100-token ones 150 KB.
    """
    if inp.decode_runs is None:
        return False
    row_bytes = 2 * kv.data.shape[-2] * kv.data.shape[-1] * kv.data.element_size()  # K and V of one position
    mean_context = sum(length for _, length in inp.decode_runs) / len(inp.decode_runs)
    return mean_context * row_bytes >= DECODE_IN_PLACE_MIN_BYTES


def stage_weight_names(config: ModelConfig, layer_range: tuple[int, int]) -> list[str]:
    """State-dict names a model holding layers [start, end) needs (a pipeline stage's share)."""
    start, end = layer_range
    first, last = start == 0, end == config.num_layers
    names = []
    if first or (last and config.tie_word_embeddings):
        names.append("model.embed_tokens.weight")
    if last:
        names.append("model.norm.weight")
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
    for i in range(start, end):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    return names


def _layer_weights(w, p: str) -> dict[str, torch.Tensor]:
    """Layer `p`'s weights, through w(name), with Q/K/V and gate/up fused into one matrix each."""
    return dict(
        attn_norm=w(p + "input_layernorm.weight"),
        qkv=torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous(),
        o=w(p + "self_attn.o_proj.weight"),
        ffn_norm=w(p + "post_attention_layernorm.weight"),
        gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]).contiguous(),
        down=w(p + "mlp.down_proj.weight"),
    )


def _layer_blocks(blocks: dict[str, GGUFWeight], p: str) -> dict[str, BlockWeight | None]:
    """Layer `p`'s fused weights in GGUF blocks, as _layer_weights fuses them; None where a part has none."""
    part = blocks.get
    return dict(qkv=concat([part(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                o=part(p + "self_attn.o_proj.weight"),
                gate_up=concat([part(p + "mlp.gate_proj.weight"), part(p + "mlp.up_proj.weight")]),
                down=part(p + "mlp.down_proj.weight"))


def _rope_tables(c: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (see apply_rope) of every position's rotary angles: [max_position, head_dim] each,
    computed in fp32 and rounded to `dtype`."""
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim))
    freqs = torch.arange(c.max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(device, dtype)
    sin = emb.sin()
    half = c.head_dim // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device, dtype)


def _unprofiled(_name: str, fn):
    return fn()


def causal_mask(start: int, end: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[end - start, end]: which of positions [0, end) the queries at positions [start, end) see."""
    return torch.arange(end, device=device)[None, :] <= torch.arange(start, end, device=device)[:, None]


def _span_queries(span: PrefillSpan, wanted: list[int] | None) -> tuple[int, int] | None:
    """The chunk's queries [first, end), of its own rows, that cover the `wanted` batch rows (increasing; None:
    every row); None where it has none."""
    if wanted is None:
        return 0, span.num_tokens
    lo = bisect.bisect_left(wanted, span.offset)
    hi = bisect.bisect_left(wanted, span.offset + span.num_tokens)
    return None if lo == hi else (wanted[lo] - span.offset, wanted[hi - 1] + 1 - span.offset)


class LlamaModel:
    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                 layer_range: tuple[int, int] | None = None, dtype: torch.dtype = torch.float32,
                 quantization: str | None = None, batch_invariant: bool = False,
                 gguf_blocks: dict[str, GGUFWeight] | None = None, full_last_layer: bool = False) -> None:
        """`layer_range` = (start, end): hold only layers [start, end), as a pipeline stage does.

        The first stage holds the embedding, the last the final norm and LM head; the default is
        the whole model. `dtype` and `quantization`: see charioteer.model.precision.
        `batch_invariant`: each row's logits bitwise independent of its batch (charioteer.model.invariant).
        `gguf_blocks` (quantization="gguf"): the GGUF file's own blocks of the state dict's weights.
        `full_last_layer`: every row through the model's last layer, as through the others. By default the
        last layer stores every row's K and V but runs its attention output, O projection and MLP only on
        the rows whose logits are wanted (run_layers' `out_rows`), as llama.cpp does: a prompt chunk's other
        rows end there. Benchmarks that time one or two layers for a deeper model's sake set it.
        """
        if quantization not in (None,) + QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
        if quantization == "gguf" and not gguf_blocks:
            raise ValueError(f"quantization='gguf' runs a GGUF file's own {', '.join(KINDS)} blocks, and this model "
                             "has none: load it from a .gguf file (the default model is one), or use "
                             "quantization='int8'")
        self._gguf_blocks = gguf_blocks if quantization == "gguf" else {}
        self.config = config
        self.device = torch.device(device)
        self.dtype, self.quantization = dtype, quantization
        if self.device.type == "cpu":
            tune_allocator()
        self._gather_buffers: list[torch.Tensor | None] = [None, None]  # K and V, see _gather
        start, end = layer_range or (0, config.num_layers)
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is not inside the model's {config.num_layers} layers")
        self.layer_range = (start, end)
        self.is_first, self.is_last = start == 0, end == config.num_layers
        self.full_last_layer = full_last_layer
        self.kernels = Kernels.choose(config, self.device, dtype, quantization == "int8", batch_invariant,
                                      gguf=quantization == "gguf")
        self.activation_dtype = self.kernels.activation_dtype(dtype)
        self._load_weights(state_dict)
        self._prepare_kernels()
        self.cos_table, self.signed_sin_table = _rope_tables(config, self.device, self.activation_dtype)
        # the whole model, on fp32 activations (whose norms are the row-op kernel's, as run_tokens computes them)
        self._tokens_in_one_call = (self.decode_layers is not None and self.is_first and self.is_last
                                    and self.activation_dtype == torch.float32)

    # How a batch's rows set its GEMMs' cost (the simulator's step cost model reads these).
    @property
    def small_batch_rows(self) -> int:
        return self.kernels.small_batch_rows(self.quantization == "int8")

    @property
    def widen_rows(self) -> int:
        return self.kernels.widen_rows(self.quantization == "int8")

    def _load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        c = self.config

        def w(name: str) -> torch.Tensor:  # norm weights in the activations' dtype, the rest in dtype
            return state_dict[name].to(self.device, self.activation_dtype if name.endswith("norm.weight") else self.dtype)

        needs_embed = self.is_first or (self.is_last and c.tie_word_embeddings)
        self.embed = w("model.embed_tokens.weight") if needs_embed else None
        self.lm_head = self.final_norm = None
        if self.is_last:
            self.lm_head = self.embed if c.tie_word_embeddings else w("lm_head.weight")
            self.final_norm = w("model.norm.weight")
        self.layers = [_layer_weights(w, f"model.layers.{i}.") for i in range(*self.layer_range)]

    def _prepare_kernels(self) -> None:
        """The weights in the layouts self.kernels' GEMMs read, and the one-call decode runner."""
        c, k = self.config, self.kernels

        def linear(weight: torch.Tensor, bf16_output: bool = False,
                   blocks: BlockWeight | None = None) -> Linear | NarrowLinear | GGUFLinear:
            if blocks is not None and k.gguf:
                return GGUFLinear(blocks, k.gguf_vnni, k.gguf_int8_activations)
            if self.quantization == "int8":
                return Int8Linear(weight, self.activation_dtype, k.panel_rows, k.int8_tile_rows, k.int8_tile_kernel,
                                  k.int8_vnni)
            if k.widened_bf16:
                return NarrowLinear(weight, None, k.panel_rows, k.native_bf16_rows, bf16_output, k.tile_kernel)
            return Linear(weight, k.packed_gemm, k.panel_rows, k.invariant is not None, k.onednn_fp32)

        # The layers' linear weights live in their Linear (once, in its own format). Under native
        # bf16 GEMMs every product stays bf16 as the GEMM rounded it: RoPE, the KV store, SiLU and
        # the residual add widen it as they read it, with the same bits as a widened copy and
        # without one (and the norms write the next GEMM's input in bf16: run_layers).
        blocks = [_layer_blocks(self._gguf_blocks, f"model.layers.{i}.") for i in range(*self.layer_range)]
        self.linears = [{name: linear(layer.pop(name), True, gguf[name]) for name in ("qkv", "o", "gate_up", "down")}
                        for layer, gguf in zip(self.layers, blocks)]
        # With int8 or GGUF blocks the LM head is quantized too (a tied embedding keeps its table in dtype
        # for the lookups): it is the largest matrix of a small model, a third of SmolLM2's weights.
        self.lm_head_linear = None
        if self.lm_head is not None:
            head = "model.embed_tokens.weight" if self.lm_head is self.embed else "lm_head.weight"
            self.lm_head_linear = linear(self.lm_head, blocks=self._gguf_blocks.get(head))
            if isinstance(self.lm_head_linear, (Int8Linear, GGUFLinear)) and self.lm_head is not self.embed:
                self.lm_head = None  # the quantized copy replaces it
        self._gguf_blocks = {}  # packed where they run; the file's bytes are not kept
        packed = [lin for lin in [*(lin for layer in self.linears for lin in layer.values()), self.lm_head_linear]
                  if lin is not None and lin.panels is not None]
        for lin, panels in zip(packed, huge_pages.into_arena([lin.panels for lin in packed])):
            lin.panels = panels
        self.decode_layers = self.decode_runner() if k.decode_layers else None
        # Where the O projection rounds its input to bf16 whatever the rows (widened bf16 under native GEMMs), the
        # attention writes its output so (the same bits): a cast of every mixed batch's output less per layer.
        o_linears = [lin["o"] for lin in self.linears]
        self._attention_out_dtype = (torch.bfloat16 if o_linears and all(type(lin) is NarrowLinear and lin.native_rows
                                                                          for lin in o_linears) else None)

    def decode_runner(self, num_layers: int | None = None):
        """The one-call decode runner (cpu_kernels.decode_layers) of this model's first `num_layers` layers (all by
        default); a runner of fewer layers times them with their weights in the caches (`bench single-stream
        --parts`)."""
        c, k = self.config, self.kernels
        layers, linears = self.layers[:num_layers], self.linears[:num_layers]
        return cpu_kernels.decode_layers(
            [layer["attn_norm"] for layer in layers], [lin["qkv"].panels for lin in linears],
            [lin["o"].panels for lin in linears], [layer["ffn_norm"] for layer in layers],
            [lin["gate_up"].panels for lin in linears], [lin["down"].panels for lin in linears],
            heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate=c.intermediate_size,
            eps=c.rms_norm_eps, scale=c.head_dim ** -0.5,
            weight_scales=[lin[name].scale for lin in linears for name in ("qkv", "o", "gate_up", "down")]
            if self.quantization == "int8" else None,
            plain_weights=[lin[name].weight for lin in linears for name in ("qkv", "o", "gate_up", "down")]
            if k.native_bf16_rows else None, native_rows=k.native_bf16_rows or k.int8_tile_rows,
            amx_tiles="amx" in (k.tile_kernel, k.int8_tile_kernel), vnni=k.int8_vnni or k.gguf_vnni)

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.final_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        tensors = [t for t in tensors if t is not None]
        tensors += [t for layer in self.layers for t in layer.values()]
        linears = [lin for layer in self.linears for lin in layer.values()]
        if isinstance(self.lm_head_linear, (Int8Linear, GGUFLinear)):  # its own copy, beside a tied embedding or not
            linears.append(self.lm_head_linear)
        return sum(t.numel() * t.element_size() for t in tensors) + sum(lin.nbytes for lin in linears)

    @property
    def streamed_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: every linear layer's, the norms' and the LM head's (an
        embedding lookup reads only its rows)."""
        norms = [t for layer in self.layers for t in layer.values()] + [t for t in [self.final_norm] if t is not None]
        linears = [lin for layer in self.linears for lin in layer.values()]
        linears += [self.lm_head_linear] if self.lm_head_linear is not None else []
        return sum(t.numel() * t.element_size() for t in norms) + sum(lin.nbytes for lin in linears)

    @torch.inference_mode()
    def forward(self, inp: ForwardInput, kv: KVCache, hooks=None) -> torch.Tensor:
        """Run the batch, write its K/V into `kv`, return logits for `inp.logits_rows`.

        `hooks`, if given, is called as hooks(op_name, fn) around each operation, for profiling.
        """
        if hooks is None and self.decodes_in_one_call(inp, kv):
            return self.lm_head_linear(self.run_decodes(inp, kv.data))
        x = self.run_layers(self.embed_tokens(inp), inp, kv, hooks, scratch_input=True, out_rows=inp.logits_rows)
        return self.logits(x, hooks)

    def decodes_in_one_call(self, inp: ForwardInput, kv: KVCache) -> bool:
        """Whether an unprofiled forward pass of `inp` runs the embedding, every layer and the final norm in one
        C++ call (`run_decodes`): a decode-only batch whose every row samples, on fp32 activations."""
        return (self._tokens_in_one_call and inp.logits_rows.numel() == inp.num_decodes
                and select_paths(self.kernels, inp, kv, profiled=False).decode_layers)

    @torch.inference_mode()
    def run_decodes(self, inp: ForwardInput, kv_data: torch.Tensor, runner=None) -> torch.Tensor:
        """The final norm's output [D, hidden] of a batch that `decodes_in_one_call`: the ops of run_layers, the
        same bits. `runner`: a `decode_runner` of the first layers, with `kv_data` holding only theirs."""
        runner = runner or self.decode_layers
        return runner.run_tokens(inp.token_ids, inp.positions, self.embed, self.cos_table, self.signed_sin_table,
                                 self.final_norm, kv_data, inp.slot_mapping, inp.decode_slots, inp.decode_lengths)

    @torch.inference_mode()
    def embed_tokens(self, inp: ForwardInput) -> torch.Tensor:
        """The first stage's input: [T, hidden] embeddings of the batch's tokens."""
        # index_select copies whole rows; advanced indexing (embed[ids]) went element by element: 143 against
        # 17 us for 128 rows of LLaMA-7B's 4096 in bf16
        return torch.index_select(self.embed, 0, inp.token_ids).to(self.activation_dtype)

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, inp: ForwardInput, kv: KVCache, hooks=None,
                   scratch_input: bool = False, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run this model's layers over hidden states x [T, hidden]; `kv` holds only these layers.
        `scratch_input`: x is the caller's to lose (a fresh embedding), so the residual stream may be
        updated in it, not in a copy: after a decode step's weights have streamed through the caches,
        every op costs tens of microseconds.
        `out_rows` (the last stage: the logits rows, increasing): the result holds only these rows, and
        unless `full_last_layer` the last layer computes the rest of its work on them alone."""
        c, ops = self.config, self.kernels.ops
        paths = select_paths(self.kernels, inp, kv, profiled=hooks is not None)
        cos, sin = (torch.index_select(table, 0, inp.positions) for table in (self.cos_table, self.signed_sin_table))
        x = x if scratch_input else ops.residual(x)
        h = self._first_norm(x)
        every_row = out_rows is None or out_rows.numel() == x.shape[0]  # increasing rows: all of them, in order
        if paths.decode_layers:  # the same kernels in the same order as the loop below: the same bits
            x = self.decode_layers.run(x, h, kv.data, cos, sin, inp.slot_mapping, inp.decode_slots,
                                       inp.decode_lengths)
            return x if every_row else x[out_rows]
        last = len(self.layers) - 1 if self.is_last and not every_row and not self.full_last_layer else None
        run, k_end = hooks or _unprofiled, c.q_size + c.kv_size
        bf16_norms = bool(self.kernels.native_bf16_rows)  # the next GEMM rounds its input to bf16 anyway
        contexts = self._query_contexts(inp, kv) if self.kernels.invariant else None
        for index, (layer, linear) in enumerate(zip(self.layers, self.linears)):
            qkv = run("preproj", lambda: linear["qkv"](h))
            # Q and K heads sit side by side in the fused projection: rotate them in one pass.
            qk = ops.rope(qkv[:, :k_end].view(-1, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, k_end:].view(-1, c.num_kv_heads, c.head_dim)
            rows = out_rows if index == last else None  # the rows this layer's output is wanted for
            attn = run("attention", lambda: self._attention(q, k, v, kv.data[index], inp, paths.decode_attention,
                                                             contexts, rows))
            if rows is not None:
                x = x[rows]
                if not rows.numel():  # no row samples: the layer's K and V are stored, nothing else is wanted
                    return x
            x, h = ops.add_norm(x, run("postproj", lambda: linear["o"](attn)), layer["ffn_norm"], c.rms_norm_eps,
                                bf16_norms)
            ffn = run("ffn", lambda: linear["down"](ops.silu_mul(linear["gate_up"](h))))
            if index + 1 < len(self.layers):  # the next layer's input norm, fused with the residual add
                x, h = ops.add_norm(x, ffn, self.layers[index + 1]["attn_norm"], c.rms_norm_eps, bf16_norms)
            else:
                x = x + ffn
        return x if every_row or last is not None else x[out_rows]

    def _first_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The first layer's input norm: with the native row ops, add_norm's bits, as every later layer's
        (in the batch-invariant mode a pipeline stage starts at any layer, and its bits must not change with
        that), else torch's."""
        return self._norm(x, self.layers[0]["attn_norm"])

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x's rows: the row-op kernel's (add_norm's bits for a -0.0 delta) where the native row
        ops run on fp32 rows, else torch's rms_norm."""
        eps = self.config.rms_norm_eps
        if self.kernels.row_ops and x.dtype == torch.float32:
            return cpu_kernels.rms_norm(x, weight, eps)
        if self.kernels.invariant is None:
            return rms_norm(x, weight, eps)
        return self.kernels.ops.add_norm(x, torch.full_like(x, -0.0), weight, eps)[1]  # x + -0.0 is x, bit for bit

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, hooks=None) -> torch.Tensor:
        """The last stage's output: logits [rows, vocab] from the final hidden states of the logits rows
        (run_layers' result with `out_rows`)."""
        run = hooks or _unprofiled
        return run("lm_head", lambda: self.lm_head_linear(self._norm(x, self.final_norm)))

    def _gather(self, cache: torch.Tensor, slots: torch.Tensor, which: int) -> torch.Tensor:
        """Rows `slots` of a K or V cache, copied into a buffer reused across layers and steps.

        index_select copies whole rows (advanced indexing, cache[slots], goes element by element),
        and writing into a kept buffer spares the page faults of a fresh tens-of-MB tensor per
        layer: 3 ms instead of 8-20 ms for 16 decodes of 256 tokens of LLaMA-7B, measured here.
        """
        n = slots.numel()
        buf = self._gather_buffers[which]
        if buf is None or buf.shape[0] < n:
            buf = torch.empty(n, *cache.shape[1:], device=cache.device, dtype=cache.dtype)
            self._gather_buffers[which] = buf
        return torch.index_select(cache, 0, slots, out=buf[:n])

    def _query_contexts(self, inp: ForwardInput, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch-invariant mode's attention plan: every query row's context slots and length."""
        return invariant.query_contexts(inp.prefills, inp.slot_mapping, inp.decode_slots, inp.decode_lengths,
                                        inp.num_decodes, kv.pad_slot)

    def _attention(self, q, k, v, layer_kv: torch.Tensor, inp: ForwardInput, decode_path: str | None,
                   contexts: tuple[torch.Tensor, torch.Tensor] | None = None,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """Store the batch's K/V, then attend: each prefill chunk, then the decodes along `decode_path`;
        with `contexts` (the batch-invariant mode), every query on its own against its context. `rows`
        (increasing): only these rows' output is wanted and returned; a chunk's queries past its last
        wanted one, and before its first, are not computed."""
        k_cache, v_cache = layer_kv[0], layer_kv[1]
        self.kernels.ops.store_kv(k_cache, v_cache, inp.slot_mapping, k, v)
        if contexts is not None:
            if rows is not None:
                q, contexts = q[rows], (contexts[0][rows], contexts[1][rows])
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            invariant.attend_each_query(q, k_cache, v_cache, *contexts, self.config.head_dim ** -0.5,
                                        self.kernels.invariant == "native", out)
            return out.view(q.shape[0], self.config.q_size)
        out = torch.empty(q.shape, dtype=self._attention_out_dtype or q.dtype, device=q.device)
        wanted = None if rows is None else rows.tolist()
        for span in inp.prefills:
            queries = _span_queries(span, wanted)
            if queries is not None:
                self._prefill_attention(span, q, k, v, k_cache, v_cache, out, queries)
        if decode_path is not None:
            first = q.shape[0] - inp.num_decodes
            decode = {"kernel": self._decode_kernel, "in_place": self._decode_in_place,
                      "gathered": self._decode_gathered}[decode_path]
            decode(q[first:], k_cache, v_cache, inp, out[first:])
        out = out.view(q.shape[0], self.config.q_size)
        return out if rows is None else out[rows]

    def _prefill_attention(self, span: PrefillSpan, q, k, v, k_cache, v_cache, out: torch.Tensor,
                           queries: tuple[int, int]) -> None:
        """The chunk's queries [first, end) (of its own rows) against its context."""
        c = self.config
        chunk = slice(span.offset, span.offset + span.num_tokens)
        first, end = queries
        rows, start, keys = slice(span.offset + first, span.offset + end), span.start_pos + first, span.start_pos + end
        ks, vs = (t[:keys] for t in self._prefill_context(span, k[chunk], v[chunk], k_cache, v_cache))
        if self.kernels.amx_attention:
            cpu_kernels.amx_prefill_attention(q[rows], ks, vs, start, c.head_dim ** -0.5, out[rows])  # q rounded in it
            return
        if self.kernels.vector_attention:  # q, the cache and out as they are, fp32 or bf16
            # in bf16 products where widened bf16's GEMMs take them from AVX512-BF16, as SDPA in bf16 would
            cpu_kernels.prefill_attention(q[rows], ks, vs, start, c.head_dim ** -0.5, out[rows],
                                          bf16_products=self.kernels.tile_kernel == "avx512_bf16")
            return
        # widened bf16 on a CPU with bf16 arithmetic attends in bf16, as its GEMMs run: on AMX, SDPA in
        # bf16 takes half the time of fp32 SDPA on a widened copy of the cache
        dtype = torch.bfloat16 if self.kernels.native_bf16_rows else q.dtype
        qs = q[rows].to(dtype).transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        ks, vs = ks.to(dtype), vs.to(dtype)
        causal, mask = span.context_slots is None, span.mask
        if (first, end) != (0, span.num_tokens):  # some of the chunk's queries: their rows of the causal mask
            causal, mask = False, causal_mask(start, keys, q.device)
        o = F.scaled_dot_product_attention(
            qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, enable_gqa=c.num_kv_heads != c.num_heads,
        )
        out[rows] = o[0].transpose(0, 1)

    def _prefill_context(self, span: PrefillSpan, k, v, k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [start_pos + num_tokens, kv_heads, dim] of the positions a chunk attends to, in the
        cache's dtype; k and v are the chunk's own rows, already stored."""
        if span.context_slots is None:  # a whole prompt, or a first chunk: no cached prefix
            # rounded as the cache holds them, so that a later chunk and a decode see the same K/V
            return k.to(k_cache.dtype), v.to(v_cache.dtype)
        if span.context_start is not None:  # the cache rows themselves, no copy
            run = slice(span.context_start, span.context_start + span.start_pos + span.num_tokens)
            return k_cache[run], v_cache[run]
        return self._gather(k_cache, span.context_slots, 0), self._gather(v_cache, span.context_slots, 1)

    # The decode paths of select_paths: q [D, heads, dim] of the batch's decodes, out its rows of the output.

    def _decode_kernel(self, q, k_cache, v_cache, inp: ForwardInput, out: torch.Tensor) -> None:
        args = (k_cache, v_cache, inp.decode_slots, inp.decode_lengths, self.config.head_dim ** -0.5)
        if q.dtype == out.dtype == torch.float32:
            cpu_kernels.decode_attention(q, *args, out=out)
        else:  # bf16 activations or output: the kernel computes in fp32, and its output is rounded once
            out.copy_(cpu_kernels.decode_attention(q.float(), *args))

    def _decode_in_place(self, q, k_cache, v_cache, inp: ForwardInput, out: torch.Tensor) -> None:
        gqa = self.config.num_kv_heads != self.config.num_heads
        qd = q.unsqueeze(2)  # [D, heads, 1, dim]
        for i, (start, length) in enumerate(inp.decode_runs):
            kd = k_cache[start:start + length].to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, context, dim]
            vd = v_cache[start:start + length].to(q.dtype).transpose(0, 1).unsqueeze(0)
            out[i] = F.scaled_dot_product_attention(qd[i:i + 1], kd, vd, enable_gqa=gqa)[0, :, 0]

    def _decode_gathered(self, q, k_cache, v_cache, inp: ForwardInput, out: torch.Tensor) -> None:
        c = self.config
        slots = inp.decode_slots.view(-1)
        shape = (*inp.decode_slots.shape, c.num_kv_heads, c.head_dim)
        kd = self._gather(k_cache, slots, 0).to(q.dtype).view(shape).transpose(1, 2)  # [D, kv_heads, context, dim]
        vd = self._gather(v_cache, slots, 1).to(q.dtype).view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=inp.decode_mask,
                                           enable_gqa=c.num_kv_heads != c.num_heads)
        out[:] = o.squeeze(2)
