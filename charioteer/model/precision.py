"""The model's number formats: what `dtype` and `quantization` mean on the machine at hand.

- `dtype` is the format of weights, activations and the KV cache: float32, bfloat16, or auto.
  auto takes bfloat16 where the processor computes it natively (AMX or AVX512-BF16 on a CPU,
  bf16 support on a GPU), and float32 elsewhere.
- On a CPU, bfloat16 runs *widened* (`bf16_compute`) wherever the CPU kernels run: weights and KV
  cache stay bf16, so a decode step reads half of fp32's bytes, and the kernels widen them to fp32
  as they load them; activations are fp32. Where the CPU has no bf16 arithmetic (AVX2, plain
  AVX-512) torch's bf16 matmul runs at a seventh of fp32's rate, so every GEMM widens.
- Where it has (AMX, AVX512-BF16), a GEMM of NATIVE_BF16_MIN_ROWS rows or more, and a prompt's
  attention, run in bf16 (`native_bf16_gemm`): the input rounded to bf16, the product widened back
  (the rows below oneDNN's go to our tile kernels instead where they run: llama.Kernels.tile_kernel). The panel
  kernel is faster only up to a few rows; widened with AMX GEMMs ran SmolLM2's chat workload 1.2x
  faster than torch's bf16 ops, and LLaMA-7B layers as fast. Its weights are reordered once for
  oneDNN (`pack_native_bf16`), as torch's own bf16 linear reorders them at every call.
  CHARIOTEER_NATIVE_BF16_GEMM=0 keeps every GEMM widened, CHARIOTEER_ONEDNN_PACK=0 the native
  ones on unpacked weights; CHARIOTEER_BF16_COMPUTE=widened|torch forces one way (torch: torch's
  bf16 ops throughout, as on a GPU or without the kernels).
- `quantization="int8"` stores each linear layer's weight and the LM head as int8 with one scale
  per output channel (symmetric, max |w| / 127) and multiplies in `dtype` (weight-only,
  W8A16/W8A32). The embedding's table stays in `dtype` (a lookup reads one row).
- `quantization="gguf"` runs a GGUF file's linear layers and LM head in the file's own blocks (the kinds of
  charioteer.model.gguf_blocks.KINDS), as llama.cpp does, with fp32 activations;
  weights of other kinds run as `dtype`'s. The default model's file is Q4_1 (the LM head Q8_0): 0.63 bytes
  a weight against int8's 1.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from charioteer.runtime import switched_on

DTYPES = ("float32", "bfloat16", "auto")
QUANTIZATIONS = ("int8", "gguf")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names


def cpuinfo_field(name: str) -> str | None:
    """The value of the first `name : value` line in /proc/cpuinfo, or None where there is none (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def cpu_vendor() -> str | None:
    """The CPU's vendor_id ("GenuineIntel", "AuthenticAMD"), or None where /proc/cpuinfo has none."""
    return cpuinfo_field("vendor_id")


FP32_GEMMS = ("auto", "mkl", "onednn")


def onednn_fp32_gemm(device: torch.device, vendor: str | None = None) -> bool:
    """Whether fp32 GEMMs above the panel kernel's rows run oneDNN on a once-reordered weight instead
    of MKL (CHARIOTEER_FP32_GEMM=mkl|onednn, default auto: oneDNN on a CPU not Intel's). MKL picks its
    code path by vendor: on an AMD Zen 4 its sgemm ran 0.5-0.9x oneDNN's speed on SmolLM2's and a
    LLaMA-7B layer's shapes from 16 to 512 rows (`vendor`: default /proc/cpuinfo's)."""
    setting = os.environ.get("CHARIOTEER_FP32_GEMM", "auto").strip().lower()
    if setting not in FP32_GEMMS:
        raise ValueError(f"CHARIOTEER_FP32_GEMM={setting} is none of {', '.join(FP32_GEMMS)}")
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() or setting == "mkl":
        return False
    vendor = cpu_vendor() if vendor is None else vendor
    return setting == "onednn" or (vendor is not None and vendor != "GenuineIntel")


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where there is none (not Linux)."""
    flags = cpuinfo_field("flags")
    return None if flags is None else set(flags.split())


def native_bf16(device: torch.device, flags: set[str] | None = None) -> bool:
    """Whether `device` computes bf16 matmuls natively (`flags`: the CPU's, default /proc/cpuinfo's)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    flags = cpu_flags() if flags is None else flags
    return bool(flags) and any(flag in flags for flag in NATIVE_BF16_FLAGS)


BF16_COMPUTE = ("auto", "widened", "torch")


def bf16_compute(device: torch.device) -> str:
    """How bf16 weights compute on `device`: "torch" (bf16 ops) or "widened" (fp32 activations in the
    CPU kernels, used where they run), from CHARIOTEER_BF16_COMPUTE, default auto: widened on a CPU,
    torch elsewhere."""
    setting = os.environ.get("CHARIOTEER_BF16_COMPUTE", "auto").strip().lower()
    if setting not in BF16_COMPUTE:
        raise ValueError(f"CHARIOTEER_BF16_COMPUTE={setting} is none of {', '.join(BF16_COMPUTE)}")
    if device.type != "cpu":
        return "torch"
    return "widened" if setting == "auto" else setting


def native_bf16_gemm(device: torch.device, flags: set[str] | None = None) -> bool:
    """Whether widened bf16's larger GEMMs run in torch's native bf16 (AMX) on `device`: where it
    computes bf16 natively, unless CHARIOTEER_NATIVE_BF16_GEMM=0."""
    return switched_on("CHARIOTEER_NATIVE_BF16_GEMM") and native_bf16(device, flags)


def pack_native_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [out, in] for `native_bf16_linear`: reordered once into oneDNN's blocked layout
    where torch's oneDNN computes bf16 (an opaque tensor, in place of the plain one), else as it is.
    F.linear on the plain weight reorders it at every call: 1.4-1.7x slower for 8 to 256 rows on
    SmolLM2's layers with AMX. CHARIOTEER_ONEDNN_PACK=0 keeps it plain."""
    if weight.device.type != "cpu" or not onednn_packs_bf16():
        return weight
    return onednn_reorder(weight)


def onednn_reorder(weight: torch.Tensor) -> torch.Tensor:
    """A weight [out, in] reordered once into oneDNN's blocked layout (an opaque tensor), for `onednn_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def onednn_linear(x: torch.Tensor, reordered: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN, in x's dtype, for a weight from `onednn_reorder`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), reordered, None, "none", [], None)


def onednn_packs_bf16() -> bool:
    """Whether `pack_native_bf16` packs: torch's oneDNN runs bf16 on this CPU, and
    CHARIOTEER_ONEDNN_PACK is not 0."""
    return (switched_on("CHARIOTEER_ONEDNN_PACK") and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def native_bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in bf16 for x bf16 [rows, in] and a weight from `pack_native_bf16`."""
    if weight.is_mkldnn:
        return onednn_linear(x, weight)
    return torch.nn.functional.linear(x, weight)


def resolve_dtype(name: str, device: torch.device, flags: set[str] | None = None) -> torch.dtype:
    """The torch dtype that the setting `name` means on `device`."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device, flags) else torch.float32
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in TORCH_DTYPES.items()}[dtype]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per output row) with weight ~= int8 * scale[:, None]."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale
