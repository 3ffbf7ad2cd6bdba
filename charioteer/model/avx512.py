"""AVX-512 kernels for the decode step, built on first use: a panel GEMM and in-place decode attention.

A decode step reads every weight once for a handful of rows, and every request's cached context
once for one query token; both are bound by memory streams, and both pay for the way MKL and
SDPA run such small shapes.

- `linear`: y = x @ w.T for up to 32 rows. The weight is repacked once into panels of 32
  output columns, one contiguous stream each, prefetched into L2. At 16 rows it reads SmolLM2's
  layer weights at about 19 GB/s against MKL's packed GEMM's 15, and the LM head 1.5x faster
  (`charioteer bench roofline --decode-stream`). Each output is summed over k in order, so a
  row's result does not depend on the other rows of its batch.
- `decode_attention`: each decode's query against its own context, read in place through its
  slot list, with no padded copy of the contexts and one call for the whole batch.
- Row ops (`add_rms_norm_`, `rope`, `silu_mul`, `argmax_rows`, `store_kv`): one call each instead
  of two to five small torch ops, which cost 4-30 us apiece on a 16-row batch.
- `decode_layers`: all of the above for every layer of a decode-only batch in one C++ call.

The kernels are compiled with torch's C++ extension loader (ninja, g++) once per machine and
cached. Without AVX-512 or a compiler, or with CHARIOTEER_AVX512=0, `available()` is False and the
model keeps MKL's GEMMs and SDPA.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

PANEL = 32  # output columns per packed panel; kernels/panel_gemm.cpp's kPanel
MAX_ROWS = 32  # above this MKL is as fast or faster (bench roofline --decode-stream --rows N)
HEAD_DIMS = (64, 128)  # head sizes decode_attention is built for

_KERNELS = Path(__file__).parent / "kernels"
_SOURCES = [_KERNELS / name for name in
            ("bindings.cpp", "panel_gemm.cpp", "decode_attention.cpp", "row_ops.cpp", "decode_layers.cpp")]
_HEADERS = [_KERNELS / name for name in ("vec_math.h", "kernels.h")]
# No implicit fused multiply-adds: rope must round like the op-by-op formula (the kernels that
# want FMAs ask for them by intrinsic).
_FLAGS = ["-O3", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mfma", "-ffp-contract=off", "-fopenmp"]
_log = logging.getLogger(__name__)
_module = None
_unavailable: str | None = None


def _build_directory() -> Path:
    """A cache folder per source, flags and torch version, so a changed kernel is never stale."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + " ".join(_FLAGS).encode()
                         + torch.__version__.encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "charioteer" / "kernels"
    folder = cache / f"avx512-{key.hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _build():
    from torch.utils import cpp_extension

    try:  # the ninja wheel's binary, when the venv's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    folder = _build_directory()
    if not any(folder.glob("*.so")):
        print("charioteer: building the AVX-512 kernels for this CPU (once, about 40 s)", file=sys.stderr)
    return cpp_extension.load("charioteer_avx512", [str(p) for p in _SOURCES], extra_cflags=_FLAGS,
                              build_directory=str(folder), verbose=False)


def unavailable_reason() -> str | None:
    """None when the kernels can run here, else why not (after trying to build them once)."""
    global _module, _unavailable
    if _module is not None or _unavailable is not None:
        return _unavailable
    if os.environ.get("CHARIOTEER_AVX512", "1") == "0":
        _unavailable = "disabled by CHARIOTEER_AVX512=0"
    elif torch.backends.cpu.get_cpu_capability() != "AVX512":
        _unavailable = f"the CPU's vector capability is {torch.backends.cpu.get_cpu_capability()}, not AVX512"
    else:
        try:
            _module = _build()
        except Exception as exc:  # noqa: BLE001 - no compiler or ninja: fall back to MKL and SDPA, say why once
            _unavailable = f"building them failed ({type(exc).__name__}: {str(exc).strip()[-300:]})"
    if _unavailable is not None:
        _log.warning("AVX-512 kernels not used, MKL's GEMMs and SDPA run instead: %s", _unavailable)
    return _unavailable


def available() -> bool:
    return unavailable_reason() is None


def _kernels():
    if _module is None and unavailable_reason() is not None:
        raise RuntimeError(f"the AVX-512 kernels are not available: {unavailable_reason()}")
    return _module


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [ceil(N/32), K, 32] panels, zero-padded past N."""
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    padded = weight.new_zeros(num_panels * PANEL, k)
    padded[:n] = weight
    return padded.view(num_panels, PANEL, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] @ w.T -> [M, n], with `panels` = pack(w) and n = w.shape[0]."""
    return _kernels().panel_linear(x, panels, n)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q K^T * scale) V per decode, K and V read in place: q [D, heads, dim] (rows may be
    strided), caches [slots, kv_heads, dim], slots [D, width] (row d's first lengths[d] entries are
    its context). Writes `out` (default a new [D, heads, dim] tensor) and returns it; query head h
    reads KV head h // (heads / kv_heads)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _kernels().decode_attention(q, k_cache, v_cache, slots, lengths, scale, out)
    return out


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_cache[slot_mapping] = k and v_cache[slot_mapping] = v, with k, v [T, kv_heads, dim] (rows may be
    strided): index_copy_ without its per-element indexing, which costs 20 us a call on cold cache rows."""
    _kernels().store_kv(k_cache, v_cache, slot_mapping, k, v)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place; returns weight * x / sqrt(mean(x^2) + eps) per row."""
    return _kernels().add_rms_norm_(x, delta, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] * cos [T, dim] + roll(x, dim/2) * signed_sin [T, dim], bitwise llama.apply_rope."""
    return _kernels().rope(x, cos, signed_sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] fused gate/up projection -> silu(gate) * up, [T, I]."""
    return _kernels().silu_mul(gate_up)


def decode_layers(attn_norm: list[torch.Tensor], qkv: list[torch.Tensor], o: list[torch.Tensor],
                  ffn_norm: list[torch.Tensor], gate_up: list[torch.Tensor], down: list[torch.Tensor], *, heads: int,
                  kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float):
    """A runner of every layer for decode-only batches, on the kernels above in one C++ call.

    Per layer: the input and post-attention norm weights and the packed (`pack`) fused QKV, O,
    fused gate/up and down weights. `.run(x, h, kv, cos, signed_sin, slot_mapping, slots,
    lengths)` updates x [D, hidden] in place and returns it; h is x's first input norm, kv the
    [layers, 2, slots + 1, kv_heads, dim] cache, slots and lengths as for `decode_attention`.
    """
    return _kernels().DecodeLayers(attn_norm, qkv, o, ffn_norm, gate_up, down, heads, kv_heads, head_dim,
                                   intermediate, eps, scale)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum (NaN counts as the maximum, as in torch.argmax)."""
    return _kernels().argmax_rows(logits)
