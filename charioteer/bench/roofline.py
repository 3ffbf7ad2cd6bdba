"""The machine's roofline: peak fp32 matmul FLOP/s and memory bandwidth, measured and cached.

Every benchmark states these beside its numbers, so "how close to the limit" is always visible.
The first measurement on a device takes a few seconds; later ones read the cache
(`$XDG_CACHE_HOME/charioteer/roofline.json`), keyed by device, processor and thread count.
"""
from __future__ import annotations

import json
import os
import platform
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_peak_matmul_flops(device: torch.device, repeats: int = 5) -> float:
    """Best fp32 FLOP/s over a few large LLaMA-like GEMMs (tokens x hidden @ hidden x ffn)."""
    shapes = [(512, 4096, 11008), (1024, 4096, 4096)] if device.type == "cpu" else [(8192, 8192, 8192), (16384, 8192, 8192)]
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device)
        b = torch.randn(k, n, device=device)
        seconds = _best_time(lambda: a @ b, device, repeats)
        best = max(best, 2 * m * k * n / seconds)
    return best


def measure_memory_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: a matrix-vector product over 512 MB (1 GB on GPUs) of fp32 weights.

    That is exactly what a decode step does, so it is the bandwidth decodes can reach.
    """
    rows = 32768 if device.type == "cpu" else 65536
    w = torch.randn(rows, 4096, device=device)
    x = torch.randn(4096, device=device)
    seconds = _best_time(lambda: w @ x, device, repeats)
    return w.numel() * w.element_size() / seconds


def _key(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
        except OSError:
            pass
    return f"{device.type}|{name}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def _cache_path() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "charioteer", "roofline.json")


def roofline(device: str | torch.device = "cpu", refresh: bool = False) -> dict:
    """{"device", "peak_matmul_gflops", "memory_bandwidth_gbs", "ridge_flops_per_byte", ...}, cached."""
    device = torch.device(device)
    key = _key(device)
    path = _cache_path()
    cache: dict = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                cache = json.load(f)
        except (OSError, ValueError):
            cache = {}
    if key in cache and not refresh:
        return {**cache[key], "cached": True}
    peak = measure_peak_matmul_flops(device)
    bandwidth = measure_memory_bandwidth(device)
    entry = {
        "device": key,
        "peak_matmul_gflops": round(peak / 1e9, 1),
        "memory_bandwidth_gbs": round(bandwidth / 1e9, 1),
        # fp32 FLOPs per byte at which a kernel turns from bandwidth- to compute-bound
        "ridge_flops_per_byte": round(peak / bandwidth, 1),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    cache[key] = entry
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(cache, f, indent=2)
    except OSError:
        pass  # a read-only home still gets the numbers, just not cached
    return {**entry, "cached": False}


def matmul_sweep(device: str | torch.device = "cpu", rows=(1, 8, 16, 32, 64, 71, 128, 256, 1024),
                 shape: tuple[int, int] = (22016, 4096), repeats: int = 5) -> list[dict]:
    """GFLOP/s of y = x @ W.T by batch rows, for plain F.linear and, on CPU, MKL's packed GEMM and
    the CPU kernels' panel GEMM (the latter up to the rows the engine gives it)."""
    import torch.nn.functional as F

    from charioteer.model import cpu_kernels
    from charioteer.model.llama import PACKED_GEMM_MAX_ROWS, packed_gemm_available

    device = torch.device(device)
    n, k = shape
    w = torch.randn(n, k, device=device)
    packed = (torch.ops.mkl._mkl_reorder_linear_weight(w, PACKED_GEMM_MAX_ROWS)
              if packed_gemm_available(device) else None)
    panels = cpu_kernels.pack(w) if device.type == "cpu" and cpu_kernels.available() else None
    out = []
    for m in rows:
        x = torch.randn(m, k, device=device)
        flops = 2 * m * n * k
        row = {"rows": m, "linear_gflops": round(flops / _best_time(lambda: F.linear(x, w), device, repeats) / 1e9, 1)}
        if packed is not None:
            t = _best_time(lambda: torch.ops.mkl._mkl_linear(x, packed, w, None, m), device, repeats)
            row["packed_gflops"] = round(flops / t / 1e9, 1)
        if panels is not None and m <= cpu_kernels.MAX_ROWS:
            t = _best_time(lambda: cpu_kernels.linear(x, panels, n), device, repeats)
            row["panel_gflops"] = round(flops / t / 1e9, 1)
        out.append(row)
    return out


def decode_gemm_stream(device: str | torch.device = "cpu", rows: int = 16, layers: int = 30, hidden: int = 576,
                       intermediate: int = 1536, heads: int = 9, kv_heads: int = 3, vocab: int = 49152,
                       repeats: int = 5) -> list[dict]:
    """One decode step's linear layers, each GEMM with its own weight, so the weights stream from memory.

    Random weights with a model's layer shapes (QKV, O, gate/up, down per layer; the defaults are
    SmolLM2-135M's), `rows` batch rows, timed per GEMM backend: plain F.linear (MKL sgemm), MKL's
    packed GEMM (the engine's path for 33-64 rows), the panel kernel (its path up to 32 rows,
    charioteer.model.cpu_kernels) and oneDNN's packed linear where torch has them.
    Reports the layers' time, the weight bytes read per second and GFLOP/s, and the LM head's
    time and GB/s on its own ([vocab, hidden], as tied to the embedding).
    """
    import torch.nn.functional as F

    from charioteer.model import cpu_kernels
    from charioteer.model.llama import PACKED_GEMM_MAX_ROWS, packed_gemm_available

    device = torch.device(device)
    h, inter, head_dim = hidden, intermediate, hidden // heads
    shapes = [((heads + 2 * kv_heads) * head_dim, h), (h, heads * head_dim), (2 * inter, h), (h, inter)]
    weights = [torch.randn(n, k, device=device) * 0.02 for _ in range(layers) for n, k in shapes]
    inputs = {k: torch.randn(rows, k, device=device) for _, k in shapes}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flops = 2 * rows * nbytes / 4

    lm_head = torch.randn(vocab, h, device=device) * 0.02
    lm_input = torch.randn(rows, h, device=device)

    def timed(name: str, prepare, call) -> dict:
        prepared = [prepare(w) for w in weights]
        t = _best_time(lambda: [call(inputs[w.shape[1]], p, w) for p, w in zip(prepared, weights)], device, repeats)
        head = prepare(lm_head)
        t_head = _best_time(lambda: call(lm_input, head, lm_head), device, repeats)
        return {"backend": name, "ms": round(t * 1e3, 2), "weight_gbs": round(nbytes / t / 1e9, 1),
                "gflops": round(flops / t / 1e9, 1), "lm_head_ms": round(t_head * 1e3, 2),
                "lm_head_gbs": round(lm_head.numel() * 4 / t_head / 1e9, 1)}

    out = [timed("F.linear", lambda w: None, lambda x, p, w: F.linear(x, w))]
    if device.type == "cpu" and cpu_kernels.available():
        out.append(timed(f"panel ({cpu_kernels.chosen_isa()})", cpu_kernels.pack,
                         lambda x, p, w: cpu_kernels.linear(x, p, w.shape[0])))
    if packed_gemm_available(device):
        out.append(timed("mkl packed", lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, PACKED_GEMM_MAX_ROWS),
                         lambda x, p, w: torch.ops.mkl._mkl_linear(x, p, w, None, rows)))
    if (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))):
        out.append(timed("onednn packed", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, rows),
                         lambda x, p, w: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")))
    for row in out:
        row.update(rows=rows, weight_mb=round(nbytes / 1e6, 1))
    return out


def describe(r: dict) -> str:
    return (f"roofline: peak fp32 matmul {r['peak_matmul_gflops']:.0f} GFLOP/s, memory bandwidth "
            f"{r['memory_bandwidth_gbs']:.1f} GB/s, ridge {r['ridge_flops_per_byte']:.0f} FLOP/byte "
            f"({r['device']}{', cached' if r.get('cached') else ''})")
