"""The CPU kernels of the decode step, for AVX-512 or AVX2 + FMA, built on first use.

A decode step reads every weight once for a handful of rows, and every request's cached context
once for one query token; both are bound by memory streams, and both pay for the way MKL and
SDPA run such small shapes.

- `linear`: y = x @ w.T for up to `max_rows()` rows (32 on AVX-512, 128 on AVX2). The weight is
  repacked once into panels of output columns (32 for AVX-512, 24 for AVX2), one contiguous stream
  each, prefetched into L2; fp32, or bf16 or int8 widened to fp32 in registers. At 16
  rows, on AVX-512, it reads SmolLM2's layer weights at about 19 GB/s against MKL's packed GEMM's
  15, and the LM head 1.5x faster (`charioteer bench roofline --decode-stream`). Each output is
  summed over k in order, so a row's result does not depend on the other rows of its batch.
- `decode_attention`: each decode's query against its own context, read in place through its
  slot list, with no padded copy of the contexts and one call for the whole batch; the cache may
  be bf16 (widened bf16, charioteer.model.precision). A context longer than `decode_attention_chunk`
  is split into equal chunks that any thread may take, then combined in order.
- Row ops (`add_rms_norm_`, `rms_norm`, `rope`, `silu_mul`, `argmax_rows`, `store_kv`): one call each instead
  of two to five small torch ops, which cost 4-30 us apiece on a 16-row batch.
- `decode_layers`: all of the above for every layer of a decode-only batch in one C++ call.
- `amx_linear`: bf16 GEMMs of up to about a hundred rows on AMX tiles, where the CPU has them
  (`amx_available`; CHARIOTEER_AMX=0 turns it off): the weight packed in tile order and streamed
  once, x read in place, C in 32 x 32 blocks. On SmolLM2's layers and a LLaMA-7B layer it is
  1.15-1.45x faster than oneDNN's bf16 GEMM from 1 to 64 rows, where oneDNN pays a per-call cost,
  and as fast at about 200 rows (llama.AMX_MAX_ROWS).
- `avx512_bf16_linear`: the same product on the same packed weight with AVX512-BF16's `vdpbf16ps`,
  for CPUs that have it but no AMX (Zen 4; `avx512_bf16_unavailable_reason`, CHARIOTEER_AVX512_BF16=0
  turns it off): 1.2-1.5x faster than oneDNN's bf16 GEMM on SmolLM2's layers from 1 to 16 rows, as
  fast at 256 (llama.AVX512_BF16_MAX_ROWS).
- `prefill_attention`: a prompt chunk's causal attention (flash attention in vectors, K packed per
  call; fp32 or bf16 in and out, computed in fp32 or, with AVX512-BF16, in bf16 products): each
  block of 16 queries reads only the keys it sees. SmolLM2's chunks 1.4-2.4x faster than torch's
  SDPA in fp32 on a Zen 4, 2-4x in bf16 (`charioteer bench roofline --attention`;
  CHARIOTEER_VECTOR_ATTENTION=0 keeps SDPA).
- `amx_linear_int8`: int8 weights on AMX's int8 tiles, read from the panels below, each row of x
  quantized to int16 (`amx_int8_unavailable_reason`; CHARIOTEER_AMX_INT8=0 keeps them off the tiles).
- `avx512_bf16_linear_int8`: int8 weights widened to bf16 per panel, then `avx512_bf16_linear`'s
  sums, where AVX512-BF16 runs and AMX does not (CHARIOTEER_AVX512_BF16=0 keeps the panel kernel):
  1.6-2.1x the panel kernel from 12 rows on a Zen 4 (llama.INT8_TILE_MIN_ROWS).
- `vnni_linear_int8`: int8 weights below those rows with AVX512-VNNI's vpdpwssd on the same panels, x
  quantized to int16 per block of 128 values (`vnni_unavailable_reason`; CHARIOTEER_VNNI=0 keeps the
  panel kernel): 1.1-1.2x the panel kernel at 1-2 rows of SmolLM2, 1.3-1.4x at 4, on a Zen 4. The
  same switch and check decide whether `gguf_linear` sums its products with it (vpdpbusd, vpdpwssd).

The same sources (kernels/, written over vec_math.h) are compiled once per instruction set into
their own extension module, with torch's C++ extension loader (ninja, g++), once per machine and
cached. Which one runs is chosen when first used, by what the CPU executes:
CHARIOTEER_CPU_KERNELS=avx512|avx2|off forces one (or none), auto (the default) takes the best,
and CHARIOTEER_AVX512=0 rules AVX-512 out. Without a usable one, `available()` is False
and the model keeps MKL's GEMMs and SDPA. Every function takes `isa=` to run a given build
instead of the chosen one (the tests run each build this CPU can execute).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

from charioteer.model.precision import cpu_flags
from charioteer.runtime import switched_off_reason, switched_on

ISAS = ("avx512", "avx2")  # best first: CHARIOTEER_CPU_KERNELS=auto takes the first this CPU runs
# Rows up to which `linear` beats MKL's GEMMs, per build, at 2 threads (`charioteer bench roofline
# --sweep`). AVX-512 (Xeon): 32. AVX2 (Zen 3): 1.35-2.4x faster than MKL's packed or plain sgemm
# from 16 to 128 rows on a LLaMA-7B layer's four GEMMs, and no slower at 128 on SmolLM2's; from
# 256 rows plain sgemm is as fast, and at 512 faster.
PANEL_MAX_ROWS = {"avx512": 32, "avx2": 128}
HEAD_DIMS = (64, 128)  # head sizes decode_attention is built for

_KERNELS = Path(__file__).parent / "kernels"
_SOURCES = [_KERNELS / name for name in
            ("bindings.cpp", "panel_gemm.cpp", "decode_attention.cpp", "row_ops.cpp", "decode_layers.cpp",
             "amx_gemm.cpp", "amx_attention.cpp", "avx512_bf16_gemm.cpp", "prefill_attention.cpp", "vnni_gemm.cpp",
             "gguf_gemm.cpp")]
_HEADERS = [_KERNELS / name for name in ("vec_math.h", "kernels.h", "amx_tiles.h")]
# Where builds are cached, read once at import: a process that later points XDG_CACHE_HOME elsewhere
# (the tests do, to keep a roofline cache private) must not rebuild the kernels there (2-3 minutes).
_BUILD_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "charioteer" / "kernels"
# No implicit fused multiply-adds: rope must round like the op-by-op formula (the kernels that
# want FMAs ask for them by intrinsic). Hidden symbols: both builds define the same C++ names, and
# each module must call its own when both are loaded (the tests load every build).
_COMMON_FLAGS = ["-O3", "-mfma", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden"]
_FLAGS = {"avx512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"] + _COMMON_FLAGS,
          "avx2": ["-mavx2", "-mf16c"] + _COMMON_FLAGS}  # F16C: the GGUF kernel's fp16 scales
_CPUINFO_FLAGS = {"avx512": {"avx512f", "avx512vl", "avx512bw", "avx512dq", "fma"}, "avx2": {"avx2", "fma", "f16c"}}
_TORCH_CAPABILITY = {"avx512": ("AVX512",), "avx2": ("AVX512", "AVX2")}  # torch's capabilities that include it
_log = logging.getLogger(__name__)
_modules: dict[str, object] = {}
_build_errors: dict[str, str] = {}
_chosen: tuple[str | None, str | None] | None = None  # (ISA, why none) once decided


def cannot_run(isa: str) -> str | None:
    """None when this CPU executes `isa`'s build, else why not. Torch's vector capability is
    checked against /proc/cpuinfo's flags: both must include the instruction set."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _TORCH_CAPABILITY[isa]:
        return f"the CPU's vector capability is {capability} (torch), which lacks {isa}"
    flags = cpu_flags()
    missing = sorted(_CPUINFO_FLAGS[isa] - flags) if flags is not None else []
    if missing:
        return f"/proc/cpuinfo lacks {' '.join(missing)}"
    return None


def choose_isa() -> tuple[str | None, str | None]:
    """(the ISA to run, None) or (None, why none), from the environment and the CPU."""
    setting = os.environ.get("CHARIOTEER_CPU_KERNELS", "auto").strip().lower()
    if setting == "off":
        return None, "disabled by CHARIOTEER_CPU_KERNELS=off"
    if setting not in ISAS + ("auto",):
        return None, f"CHARIOTEER_CPU_KERNELS={setting} is none of {', '.join(ISAS)}, off, auto"
    candidates = (setting,) if setting != "auto" else ISAS
    if not switched_on("CHARIOTEER_AVX512"):
        candidates = tuple(isa for isa in candidates if isa != "avx512")
    reasons = []
    for isa in candidates:
        reason = cannot_run(isa)
        if reason is None:
            return isa, None
        reasons.append(f"{isa}: {reason}")
    return None, "; ".join(reasons) or "CHARIOTEER_AVX512=0 rules out the only candidate, avx512"


STALE_BUILD_LOCK_S = 600  # a build takes 1-3 minutes


def _build_directory(isa: str) -> Path:
    """A cache folder per ISA, source, flags, torch version and checkout, so a changed kernel is never
    stale. The checkout's path is part of it because the build files name the sources by absolute path:
    two checkouts sharing a folder would rebuild it in turn."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + " ".join(_FLAGS[isa]).encode()
                         + torch.__version__.encode() + str(_SOURCES[0].parent.resolve()).encode())
    folder = _BUILD_CACHE / f"{isa}-{key.hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def clear_stale_lock(folder: Path) -> None:
    """Remove torch's build lock in `folder` when older than STALE_BUILD_LOCK_S: it has no timeout, and
    one left by a build that was killed would stall every later load."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_BUILD_LOCK_S:
        _log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def _build(isa: str):
    from torch.utils import cpp_extension

    try:  # the ninja wheel's binary, when the venv's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    folder = _build_directory(isa)
    clear_stale_lock(folder)
    if not any(folder.glob("*.so")):
        print(f"charioteer: building the {isa} CPU kernels (once, 1-3 minutes)", file=sys.stderr)
    return cpp_extension.load(f"charioteer_kernels_{isa}", [str(p) for p in _SOURCES], extra_cflags=_FLAGS[isa],
                              build_directory=str(folder), verbose=False)


def load_reason(isa: str) -> str | None:
    """None when `isa`'s build can run here (building it once if need be), else why not."""
    if isa in _modules or isa in _build_errors:
        return _build_errors.get(isa)
    reason = cannot_run(isa)
    if reason is None:
        try:
            _modules[isa] = _build(isa)
        except Exception as exc:  # noqa: BLE001 - no compiler or ninja: fall back to MKL and SDPA, say why once
            reason = f"building them failed ({type(exc).__name__}: {str(exc).strip()[-300:]})"
    if reason is not None:
        _build_errors[isa] = reason
    return reason


def chosen_isa() -> str | None:
    """The instruction set of the kernels the model runs, or None (see unavailable_reason)."""
    global _chosen
    if _chosen is None:
        chosen, why = choose_isa()
        if chosen is not None and (why := load_reason(chosen)) is not None:
            chosen = None
        _chosen = (chosen, why)
        if why is not None:
            _log.warning("CPU kernels not used, MKL's GEMMs and SDPA run instead: %s", why)
    return _chosen[0]


def unavailable_reason() -> str | None:
    """None when the chosen kernels can run here, else why there are none."""
    return None if chosen_isa() is not None else _chosen[1]


def available() -> bool:
    return chosen_isa() is not None


def status() -> str:
    """One line for setup: which kernels are ready, or why none."""
    return f"{chosen_isa()} ready" if available() else f"none ({unavailable_reason()})"


def decode_attention_chunk(isa: str | None = None) -> int:
    """Positions one work item of `decode_attention` covers at most: a longer context is split into equal chunks,
    spread over the threads and combined in order, so one long context keeps every thread busy."""
    return _kernels(isa).decode_attention_chunk


def max_rows(isa: str | None = None) -> int:
    """Rows up to which the model runs `linear` (of `isa`'s build, or the chosen one's); 0 without one."""
    isa = isa or chosen_isa()
    return PANEL_MAX_ROWS[isa] if isa else 0


def row_block(isa: str | None = None) -> int:
    """Rows `linear`'s microkernel computes at once (of `isa`'s build, or the chosen one's); 0 without one.
    With bf16 or int8 weights, a batch of more rows widens each weight slice once for all its row
    blocks; a batch of one block widens as it goes."""
    isa = isa or chosen_isa()
    return _kernels(isa).panel_row_block if isa else 0


def _kernels(isa: str | None):
    """The extension module of `isa`, or of the chosen ISA for None."""
    module = _modules.get(isa or chosen_isa())  # loaded: it runs here (each kernel call from Python asks)
    if module is not None:
        return module
    if isa is None and chosen_isa() is None:
        raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
    isa = isa or chosen_isa()
    if load_reason(isa) is not None:
        raise RuntimeError(f"the {isa} CPU kernels are not available: {load_reason(isa)}")
    return _modules[isa]


def pack(weight: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """[N, K] weight -> [ceil(N/P), K, P] panels, zero-padded past N; P (the build's panel_width)
    is 32 columns for AVX-512, 24 for AVX2. The weight keeps its dtype: fp32, bf16 or int8."""
    width = _kernels(isa).panel_width
    n, k = weight.shape
    num_panels = -(-n // width)
    padded = weight.new_zeros(num_panels * width, k)
    padded[:n] = weight
    return padded.view(num_panels, width, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, scale: torch.Tensor | None = None,
           isa: str | None = None) -> torch.Tensor:
    """x [M, K] (fp32) @ w.T -> [M, n], with `panels` = pack(w) and n = w.shape[0]. bf16 and int8
    weights are widened to fp32 in registers, so they stream half or a quarter of fp32's bytes;
    int8 weights take `scale`, fp32 [n]: the product is x @ (w * scale[:, None]).T."""
    return _kernels(isa).panel_linear(x, panels, n, scale)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                     isa: str | None = None) -> torch.Tensor:
    """softmax(q K^T * scale) V per decode, K and V read in place: q [D, heads, dim] (rows may be
    strided), caches [slots, kv_heads, dim] in fp32 or bf16 (widened exactly as read), slots [D, width]
    (row d's first lengths[d] entries are its context). Writes `out` (default a new [D, heads, dim] tensor) and returns it; query head h
    reads KV head h // (heads / kv_heads)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _kernels(isa).decode_attention(q, k_cache, v_cache, slots, lengths, scale, out)
    return out


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, isa: str | None = None) -> None:
    """k_cache[slot_mapping] = k and v_cache[slot_mapping] = v, with k, v [T, kv_heads, dim] fp32 or bf16 (rows
    may be strided) into fp32 caches, or bf16 ones (fp32 rounded to nearest even): index_copy_ without its
    per-element indexing, which costs 20 us a call on cold cache rows."""
    _kernels(isa).store_kv(k_cache, v_cache, slot_mapping, k, v)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, bf16_out: bool = False,
                  isa: str | None = None) -> torch.Tensor:
    """x (fp32) += delta (fp32, or bf16 widened exactly) in place; returns weight * x / sqrt(mean(x^2) + eps)
    per row, in fp32 or rounded to bf16 (`bf16_out`, to nearest even as torch's .to())."""
    return _kernels(isa).add_rms_norm_(x, delta, weight, eps, bf16_out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, isa: str | None = None) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) per row of x (fp32, not modified): add_rms_norm_'s bits for a delta of
    -0.0, in one call. torch's rms_norm on the CPU runs a dozen ops, each costly when a decode step's weights
    have just streamed through the caches."""
    return _kernels(isa).rms_norm(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """x [T, heads, dim] * cos [T, dim] + roll(x, dim/2) * signed_sin [T, dim] in fp32, bitwise llama.apply_rope
    (x fp32, or bf16 widened exactly)."""
    return _kernels(isa).rope(x, cos, signed_sin)


def silu_mul(gate_up: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """[T, 2I] fused gate/up projection -> silu(gate) * up, [T, I], in fp32 or bf16: bf16 computes in
    fp32 and rounds once, the fp32 result on the widened input rounded, bit for bit."""
    return _kernels(isa).silu_mul(gate_up)


def decode_layers(attn_norm: list[torch.Tensor], qkv: list[torch.Tensor], o: list[torch.Tensor],
                  ffn_norm: list[torch.Tensor], gate_up: list[torch.Tensor], down: list[torch.Tensor], *, heads: int,
                  kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float,
                  weight_scales: list[torch.Tensor] | None = None, plain_weights: list[torch.Tensor] | None = None,
                  native_rows: int = 0, amx_tiles: bool = False, vnni: bool = False, isa: str | None = None):
    """A runner of every layer for decode-only batches, on the kernels above in one C++ call.

    Per layer: the input and post-attention norm weights and the packed (`pack`) fused QKV, O,
    fused gate/up and down weights; with int8 weights, `weight_scales` holds each layer's four
    column scales (QKV, O, gate/up, down), layer after layer, and a batch of `native_rows` rows or
    more (0: none) runs `amx_linear_int8` on the panels with `amx_tiles`, else
    `avx512_bf16_linear_int8`; smaller ones run `vnni_linear_int8` with `vnni`, else the panel kernel. GGUF
    blocks (BlockWeight.pack's uint8 panels) run `gguf_linear`, with `vnni` its VNNI sums.
    With bf16 weights, `plain_weights` may hold the four unpacked in the
    same order: a batch of `native_rows` rows or more then rounds its input to bf16 for torch's bf16
    GEMM instead of the panels; smaller ones run the panels, or where the weights were packed by
    `amx_pack` instead, `amx_linear` with `amx_tiles`, else `avx512_bf16_linear`. `.run(x, h, kv,
    cos, signed_sin, slot_mapping, slots, lengths)` updates x [D, hidden] in place and returns it; h
    is x's first input norm, kv the [layers, 2, slots + 1, kv_heads, dim] cache, slots and lengths as
    for `decode_attention`. `.run_tokens(token_ids, positions, embed, cos_table, signed_sin_table, final_norm, kv,
    slot_mapping, slots, lengths)` does the same for a whole model from its tokens: the embedding's and the RoPE
    tables' rows, the first norm, `run`, and returns the final norm's output (what the LM head reads).
    """
    return _kernels(isa).DecodeLayers(attn_norm, qkv, o, ffn_norm, gate_up, down, weight_scales or [],
                                      plain_weights or [], native_rows, amx_tiles, vnni, heads, kv_heads, head_dim,
                                      intermediate, eps, scale)


AMX_FLAGS = {"amx_tile", "amx_bf16"}  # /proc/cpuinfo names
AMX_INT8_FLAGS = {"amx_tile", "amx_int8", "avx512vbmi"}  # amx_linear_int8 lays out its B tiles with vpermt2b


def amx_unavailable_reason(isa: str | None = None, flags: set[str] = AMX_FLAGS) -> str | None:
    """None when `amx_linear` runs here (the CPU has AMX-BF16 tiles, Linux grants them to this process,
    and CHARIOTEER_AMX is not 0), else why not; with AMX_INT8_FLAGS, the same for `amx_linear_int8`."""
    if reason := switched_off_reason("CHARIOTEER_AMX"):
        return reason
    if (isa or chosen_isa()) is None:
        return f"no CPU kernels ({unavailable_reason()})"
    cpu = cpu_flags()
    if not cpu or not flags <= cpu:
        return f"the CPU lacks {', '.join(sorted(flags - cpu))}"
    if not _kernels(isa).amx_ready():
        return "Linux refused this process AMX's tile state (arch_prctl)"
    return None


def amx_available(isa: str | None = None) -> bool:
    return amx_unavailable_reason(isa) is None


def amx_int8_unavailable_reason(isa: str | None = None) -> str | None:
    """None when int8 weights run on AMX tiles here (`amx_linear_int8`), else why not: as
    `amx_unavailable_reason`, and CHARIOTEER_AMX_INT8=0 keeps them on the panel kernel (fp32
    activations) where the tiles would run."""
    if reason := switched_off_reason("CHARIOTEER_AMX_INT8"):
        return reason
    reason = amx_unavailable_reason(isa, AMX_INT8_FLAGS)
    if reason is None and _kernels(isa).panel_width != 32:
        return f"the {isa or chosen_isa()} build's panels are {_kernels(isa).panel_width} columns, the tiles read 32"
    return reason


def int8_tile_kernel(isa: str | None = None) -> str | None:
    """Which tile-order kernel int8 weights take from llama.INT8_TILE_MIN_ROWS rows here: "amx"
    (`amx_linear_int8`), else "avx512_bf16" (`avx512_bf16_linear_int8`), else None (the panel kernel)."""
    if amx_int8_unavailable_reason(isa) is None:
        return "amx"
    return "avx512_bf16" if avx512_bf16_unavailable_reason(isa) is None else None


def _avx512_extension_reason(switch: str, flag: str, isa: str | None) -> str | None:
    """None when a kernel of the avx512 build that needs the CPU flag `flag` runs here and the environment
    variable `switch` is not 0, else why not."""
    if reason := switched_off_reason(switch):
        return reason
    isa = isa or chosen_isa()
    if isa != "avx512":
        return f"it is in the avx512 build only, and the kernels here are {isa or 'none'}"
    cpu = cpu_flags()
    if not cpu or flag not in cpu:
        return f"the CPU lacks {flag}"
    return None


def vnni_unavailable_reason(isa: str | None = None) -> str | None:
    """None when `vnni_linear_int8` and `gguf_linear`'s `vnni` run here (the avx512 build, a CPU with AVX512-VNNI,
    and CHARIOTEER_VNNI is not 0), else why not."""
    return _avx512_extension_reason("CHARIOTEER_VNNI", "avx512_vnni", isa)


def vnni_linear_int8(x: torch.Tensor, panels: torch.Tensor, n: int, scale: torch.Tensor,
                     isa: str | None = None) -> torch.Tensor:
    """x fp32 [M, K] @ (q * scale[:, None]).T -> fp32 [M, n] with AVX512-VNNI, for panels = pack(q) of int8 q
    (the AVX-512 build's 32-column panels, as `linear` reads them): each row's every block of 128 values of x
    quantized to int16 with its own scale (its largest magnitude / 32767), the int16 products summed exactly
    in int32 per block, then in fp32 block after block, times the column's scale. A row's result depends on
    its own row of x alone. At one row about three times fewer instructions than `linear`'s widening."""
    return _kernels(isa).vnni_linear_int8(x, panels, n, scale)


def gguf_unavailable_reason() -> str | None:
    """None when `gguf_linear` runs here (the CPU kernels, either build, and CHARIOTEER_GGUF_KERNEL is not 0),
    else why not."""
    return switched_off_reason("CHARIOTEER_GGUF_KERNEL") or unavailable_reason()


def gguf_linear(x: torch.Tensor, packed: torch.Tensor, n: int, vnni: bool = False,
                isa: str | None = None) -> torch.Tensor:
    """x fp32 [M, K] @ W.T -> fp32 [M, n] for W in a GGUF file's blocks, packed by
    gguf_blocks.BlockWeight.pack: each row's blocks of 32 values of x quantized to int16 with their own
    scale, the weights' q widened to int16, the products summed exactly in int32 per block, then scaled by
    the block's d (and m times the block's sum of quantized x where there is an m) in fp32, block after block. A
    4-bit form packed with `int8_activations` (4-d) takes x quantized to int8 instead, as llama.cpp's Q8_1, its unsigned
    q multiplied four to a lane by vpmaddubsw. A row's result depends on its own row of x alone, and is the same
    in the AVX2 and the AVX-512 build, and with `vnni` (vnni_unavailable_reason), which sums the products with
    AVX512-VNNI's vpdpwssd (vpdpbusd for int8 x): on a Zen 4, 16 requests of SmolLM2 generating 64 tokens each,
    1.04-1.09x in three runs, apart from the spread in one (BENCHMARKS.md, `bench switch`)."""
    return _kernels(isa).gguf_linear(x, packed, n, vnni)


def amx_pack(weight: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """bf16 [N, K] -> [ceil(N/16), ceil(K/32), 16, 32], zero-padded: the weight in the order AMX's
    B tiles read it, each 16 output columns one contiguous stream."""
    return _kernels(isa).amx_pack(weight)


def amx_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bf16_output: bool = False,
               isa: str | None = None) -> torch.Tensor:
    """x bf16 [M, K] @ w.T -> [M, n] on AMX tiles, for packed = amx_pack(w): products of bf16 summed in
    fp32, the result fp32 or rounded to bf16 (to nearest even). A row's result depends on its own row of
    x alone. Faster than oneDNN's bf16 GEMM up to about 128 rows (`charioteer bench roofline
    --decode-stream --dtype bfloat16 --rows N`), which is where the model uses it (llama.AMX_MAX_ROWS)."""
    return _kernels(isa).amx_linear(x, packed, n, bf16_output)


def avx512_bf16_unavailable_reason(isa: str | None = None) -> str | None:
    """None when `avx512_bf16_linear` runs here (the avx512 build, a CPU with AVX512-BF16, and
    CHARIOTEER_AVX512_BF16 is not 0), else why not."""
    return _avx512_extension_reason("CHARIOTEER_AVX512_BF16", "avx512_bf16", isa)


def avx512_bf16_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bf16_output: bool = False,
                       isa: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`amx_linear`'s product on the same packed weight (`amx_pack`) with AVX512-BF16's vdpbf16ps, for
    CPUs without AMX tiles: bf16 pairs multiplied and summed in fp32, k in order, so a row's result
    depends on its own row of x alone. Faster than oneDNN's bf16 GEMM on such CPUs up to
    llama.AVX512_BF16_MAX_ROWS rows, which is where the model uses it. x: bf16, or fp32 rounded to it
    (to nearest even, as `.to`) without a new tensor; `out`: where to write the product."""
    return _kernels(isa).avx512_bf16_linear(x, packed, n, bf16_output, out)


def amx_linear_int8(x: torch.Tensor, panels: torch.Tensor, n: int, scale: torch.Tensor,
                    isa: str | None = None) -> torch.Tensor:
    """x fp32 [M, K] @ (q * scale[:, None]).T -> fp32 [M, n] on AMX's int8 tiles, for panels = pack(q) of
    int8 q (the AVX-512 build's 32-column panels, which `linear` reads too): each row of x quantized to
    int16 with one scale (its largest magnitude over 32639, rounded to nearest even) and split into
    two signed bytes, v = 256 hi + lo; both bytes' products with q summed exactly in int32, then
    (256 hi_sum + lo_sum) times the row's and the column's scale in fp32.
    A row's result depends on its own row of x alone."""
    return _kernels(isa).amx_linear_int8(x, panels, n, scale)


def avx512_bf16_linear_int8(x: torch.Tensor, panels: torch.Tensor, n: int, scale: torch.Tensor,
                            isa: str | None = None) -> torch.Tensor:
    """x rounded to bf16 @ (q * scale[:, None]).T with AVX512-BF16's vdpbf16ps, for CPUs without AMX tiles
    (`amx_linear_int8`'s panels and result): each panel widened to bf16 once per call into a buffer
    every row block reads, then `avx512_bf16_linear`'s sums (the same bits as it gives on q in bf16),
    times the column's scale."""
    return _kernels(isa).avx512_bf16_linear_int8(x, panels, n, scale)


def amx_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                          out: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """Causal attention of a prompt chunk on AMX tiles: q [n, heads, dim] (bf16, or fp32 rounded to it as .to
    rounds), query i at position start + i, against k and v bf16 [start + n, kv_heads, dim] (rows may be
    strided), each query seeing the keys up to its own position. Products of bf16 summed in fp32, softmax in
    fp32, its weights rounded to bf16 for P V, as SDPA does in bf16. Writes `out` (fp32 or bf16, default a
    new bf16 tensor of q's shape) and returns it."""
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    _kernels(isa).amx_prefill_attention(q, k, v, start, scale, out)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                      out: torch.Tensor | None = None, bf16_products: bool = False,
                      isa: str | None = None) -> torch.Tensor:
    """Causal attention of a prompt chunk in vectors, any build: q [n, heads, dim], query i at
    position start + i, against k and v [start + n, kv_heads, dim] (rows may be strided), each query
    seeing the keys up to its own position. Each of q, k/v and out is fp32 or bf16 (widened exactly,
    computed in fp32, rounded once on output). With `bf16_products` (the avx512 build where
    avx512_bf16_unavailable_reason() is None; bf16 k and v), q and the softmax's weights are rounded to
    bf16 and the products taken with AVX512-BF16, as SDPA computes in bf16. Writes `out` (default a new
    tensor like q) and returns it."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _kernels(isa).prefill_attention(q, k, v, start, scale, out, bf16_products)
    return out


def argmax_rows(logits: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """The first index of each row's maximum (NaN counts as the maximum, as in torch.argmax)."""
    return _kernels(isa).argmax_rows(logits)
