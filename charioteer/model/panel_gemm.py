"""A decode-shaped GEMM, y = x @ w.T for up to 32 rows, built for AVX-512 CPUs on first use.

One decode step reads every weight once for a handful of rows, so its GEMMs are bound by the
weight stream. MKL's packed GEMM reads it at about 15 GB/s at 16 rows here; this kernel (a
repacked weight, one contiguous stream per 32 output columns, prefetched into L2) reads it at
about 18 GB/s and the LM head 1.5x faster (`charioteer bench roofline --decode-stream`).

Each output is summed over k in order, so a row's logits do not depend on which other rows share
its batch. The kernel is compiled with torch's C++ extension loader (ninja, g++) once per machine
and cached; without AVX-512 or a compiler, or with CHARIOTEER_PANEL_GEMM=0, `available()` is
False and the engine keeps MKL's kernels.
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

_SOURCE = Path(__file__).parent / "kernels" / "panel_gemm.cpp"
_FLAGS = ["-O3", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mfma", "-fopenmp"]
_log = logging.getLogger(__name__)
_module = None
_unavailable: str | None = None


def _build_directory() -> Path:
    """A cache folder per source, flags and torch version, so a changed kernel is never stale."""
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + torch.__version__.encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "charioteer" / "kernels"
    folder = cache / f"panel_gemm-{key.hexdigest()[:16]}"
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
        print("charioteer: building the panel GEMM kernel for this CPU (once, about 30 s)", file=sys.stderr)
    return cpp_extension.load("charioteer_panel_gemm", [str(_SOURCE)], extra_cflags=_FLAGS,
                              build_directory=str(folder), verbose=False)


def unavailable_reason() -> str | None:
    """None when the kernel can run here, else why not (after trying to build it once)."""
    global _module, _unavailable
    if _module is not None or _unavailable is not None:
        return _unavailable
    if os.environ.get("CHARIOTEER_PANEL_GEMM", "1") == "0":
        _unavailable = "disabled by CHARIOTEER_PANEL_GEMM=0"
    elif torch.backends.cpu.get_cpu_capability() != "AVX512":
        _unavailable = f"the CPU's vector capability is {torch.backends.cpu.get_cpu_capability()}, not AVX512"
    else:
        try:
            _module = _build()
        except Exception as exc:  # noqa: BLE001 - no compiler or ninja: fall back to MKL, say why once
            _unavailable = f"building it failed ({type(exc).__name__}: {str(exc).strip()[-300:]})"
    if _unavailable is not None:
        _log.warning("panel GEMM kernel not used, MKL's kernels run instead: %s", _unavailable)
    return _unavailable


def available() -> bool:
    return unavailable_reason() is None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [ceil(N/32), K, 32] panels, zero-padded past N."""
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    padded = weight.new_zeros(num_panels * PANEL, k)
    padded[:n] = weight
    return padded.view(num_panels, PANEL, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] @ w.T -> [M, n], with `panels` = pack(w) and n = w.shape[0]."""
    if _module is None and unavailable_reason() is not None:
        raise RuntimeError(f"the panel GEMM kernel is not available: {unavailable_reason()}")
    return _module.panel_linear(x, panels, n)
