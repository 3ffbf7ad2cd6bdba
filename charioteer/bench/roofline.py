"""The machine's roofline: peak matmul FLOP/s and memory bandwidth, measured, cached, and kept honest.

Every benchmark states these beside its numbers, so "how close to the limit" is always visible.

- Each number is the best of several short trials (`trials`).
- An entry is stored (`$XDG_CACHE_HOME/charioteer/roofline.json`) with what it depends on: the
  device, the processor model, its instruction-set features (`/proc/cpuinfo` flags such as avx2,
  avx512f, avx512_bf16, amx_tile) and torch's CPU capability, the thread count, the torch version
  and the dtype, and the rules for what may raise a stored peak (`PEAK_RULES`). Any change of those
  is a different entry, measured afresh.
- Each dtype has its own entry (float32 by default; bfloat16 when asked).
- A measured rate is a lower bound on the peak. Every MFU goes through `mfu()`, which checks the
  rates it is given against the stored peak: a rate above it means the stored peak was measured
  low (a busy machine, a cold clock), so `mfu()` measures the peak again, says so on stderr, and
  if the observed rate still beats the fresh peak, the observed rate becomes the peak. No MFU is
  ever above 1.
- A rate more than IMPLAUSIBLE_FACTOR above the fresh peak is not a matmul of that dtype (FLOPs
  counted for work another precision did, or miscounted): it never becomes the peak, and its MFU is
  not given. (`bench roofline --decode-stream` once let an AMX bf16 rate raise the fp32 peak of a
  2-core Xeon to 733 GFLOP/s, where 7 fresh trials find 422, and later fp32 MFUs read 0.58x too low.)
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from charioteer.bench.stats import SPREAD, interleaved, median, spread

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The /proc/cpuinfo flags that change what a matmul can reach (x86 and Arm); the rest are ignored.
CPU_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
                "asimd", "sve", "sve2", "bf16", "i8mm")
TRIALS = 7
# How far above a fresh measurement of the peak an observed rate may be and still count as a rate of that
# dtype's matmuls (a trial set on a busy machine, a cold clock, a better shape than the trials'); further
# above, the FLOPs were not that dtype's.
IMPLAUSIBLE_FACTOR = 1.5
# Part of every entry's identity, raised when the rules for what may raise a stored peak change, so that
# entries stored under older ones are measured again: 2 since bf16 rates could raise an fp32 peak.
PEAK_RULES = 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sig3(value: float) -> float:
    """`value` to 3 significant digits."""
    return float(f"{value:.3g}")


def _clocked(fn, device: torch.device = torch.device("cpu")) -> float:
    """Seconds one call of fn takes, its device work included."""
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _best_time(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    return min((_clocked(fn, device) for _ in range(repeats)), default=float("inf"))


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown roofline dtype {name!r}: choose from {', '.join(DTYPES)}")
    return DTYPES[name]


def measure_peak_matmul_flops(device: torch.device, dtype: str = "float32", trials: int = TRIALS) -> float:
    """Best FLOP/s over short trials of large LLaMA-like GEMMs (tokens x hidden times a [ffn, hidden]
    weight, as the model's F.linear runs them: on AVX2, torch's bf16 `a @ b` on an untransposed
    [hidden, ffn] takes a path 60x slower than its bf16 F.linear). Widened bf16 times the model's
    path for large batches: the weight widened to fp32, then an fp32 GEMM, or where the CPU computes
    bf16 (precision.native_bf16_gemm) torch's bf16 GEMM. fp32 takes the faster of MKL (F.linear) and
    oneDNN on a reordered weight, as the model does (precision.onednn_fp32_gemm): on an AMD Zen 4,
    MKL's sgemm ran at 0.8x oneDNN's rate."""
    import torch.nn.functional as F

    from charioteer.model.llama import bf16_runs_widened
    from charioteer.model.precision import native_bf16_gemm, onednn_linear, onednn_reorder

    device = torch.device(device)
    shapes = [(512, 4096, 11008), (1024, 4096, 4096)] if device.type == "cpu" else [(8192, 8192, 8192), (16384, 8192, 8192)]
    widened = dtype == "bfloat16" and bf16_runs_widened(device) and not native_bf16_gemm(device)
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.float32 if widened else _dtype(dtype))
        w = torch.randn(n, k, device=device, dtype=_dtype(dtype))
        calls = [(lambda: F.linear(a, w.float())) if widened else (lambda: F.linear(a, w))]
        if dtype == "float32" and device.type == "cpu" and torch.backends.mkldnn.is_available():
            reordered = onednn_reorder(w)
            calls.append(lambda: onednn_linear(a, reordered))
        for call in calls:
            best = max(best, 2 * m * k * n / _best_time(call, device, trials))
    return best


def bandwidth_readers(device: str | torch.device = "cpu") -> list[str]:
    """The matrix-vector products whose best rate is the read bandwidth: torch's, and on a CPU with
    the panel kernels theirs too (they stream faster than torch's GEMV on Zen 3: a decode step read
    its bytes at 1.1x the torch-only figure), so no decode measures above its own limit."""
    from charioteer.model import cpu_kernels

    device = torch.device(device)
    return ["torch"] + ([f"panel {cpu_kernels.chosen_isa()}"] if device.type == "cpu" and cpu_kernels.available() else [])


def bandwidth_reader(device: str | torch.device = "cpu", dtype: str = "float32") -> Callable[[int], float]:
    """A function of `trials` giving the read bandwidth in bytes/s: the best of short trials of each of
    `bandwidth_readers`, a matrix-vector product over 512 MB (1 GB on GPUs) of weights. That is exactly
    what a decode step does, so it is the bandwidth decodes can reach. The weights are made once, so a
    benchmark can read the bandwidth again between its own runs (on a shared machine it moves)."""
    from charioteer.model import cpu_kernels

    device = torch.device(device)
    dt = _dtype(dtype)
    rows = (32768 if device.type == "cpu" else 65536) * 4 // torch.tensor([], dtype=dt).element_size()
    w = torch.randn(rows, 4096, device=device, dtype=dt)
    x = torch.randn(4096, device=device, dtype=dt)
    calls = [lambda: w @ x]
    if len(bandwidth_readers(device)) > 1:
        panels = cpu_kernels.pack(w)  # the kernel widens bf16 weights: the same bytes are read
        x_rows = x.float()[None]
        calls.append(lambda: cpu_kernels.linear(x_rows, panels, rows))

    def read(trials: int) -> float:
        return rows * 4096 * dt.itemsize / min(_best_time(call, device, trials) for call in calls)

    return read


def measure_memory_bandwidth(device: torch.device, dtype: str = "float32", trials: int = TRIALS) -> float:
    """Read bandwidth in bytes/s, best of `trials` short trials of `bandwidth_reader`'s products."""
    return bandwidth_reader(device, dtype)(trials)


# ---- what a measurement depends on ------------------------------------------------------------


def _cpuinfo() -> tuple[str | None, list[str]]:
    """(model name, relevant feature flags: x86's "flags" or Arm's "Features") from /proc/cpuinfo;
    (None, []) where there is none."""
    from charioteer.model.precision import cpuinfo_field

    flags = set((cpuinfo_field("flags") or cpuinfo_field("Features") or "").split())
    return cpuinfo_field("model name"), [f for f in CPU_FEATURES if f in flags]


def cpu_model() -> str:
    return _cpuinfo()[0] or platform.processor() or platform.machine()


def cpu_features() -> list[str]:
    return _cpuinfo()[1]


def last_level_cache_bytes(cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The size of the CPU's largest cache as Linux reports it (0 where it does not): bytes that fit in it may be
    read from it rather than from memory, faster than any read bandwidth. (A VM may report its host's whole L3.)"""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for index in Path(cache_dir).glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "")
        if number.isdigit():
            sizes.append(int(number) * units.get(unit, 1))
    return max(sizes, default=0)


def torch_version() -> str:
    return torch.__version__


def identity(device: str | torch.device = "cpu", dtype: str = "float32") -> dict:
    """Everything a roofline measurement depends on; a stored entry is valid only for an equal identity."""
    device = torch.device(device)
    _dtype(dtype)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"device": "cuda", "processor": torch.cuda.get_device_name(device), "features": [f"sm_{major}{minor}"],
                "isa": f"cuda {torch.version.cuda}", "threads": None, "torch": torch_version(), "dtype": dtype,
                "peak_rules": PEAK_RULES}
    ident = {"device": device.type, "processor": cpu_model(), "features": cpu_features(),
             "isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
             "torch": torch_version(), "dtype": dtype, "bandwidth_readers": bandwidth_readers(device),
             "peak_rules": PEAK_RULES}
    if dtype == "bfloat16":
        from charioteer.model.llama import bf16_runs_widened

        from charioteer.model.precision import native_bf16_gemm

        ident["bf16_compute"] = "widened" if bf16_runs_widened(device) else "torch"
        ident["native_bf16_gemm"] = native_bf16_gemm(device)
    return ident


def _key(ident: dict) -> str:
    return "|".join(f"{k}={','.join(v) if isinstance(v, list) else v}" for k, v in ident.items())


def _cache_path() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "charioteer", "roofline.json")


def _read_cache() -> dict:
    try:
        with open(_cache_path()) as f:
            cache = json.load(f)
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(entry: dict) -> None:
    cache = _read_cache()
    # What happened in this run (read from the cache, raised from a lower peak) is not the entry's.
    skipped = ("cached", _PEAK.raised_from, _BANDWIDTH.raised_from)
    cache[entry["key"]] = {k: v for k, v in entry.items() if k not in skipped}
    path = _cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(cache, f, indent=2)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # a read-only home still gets the numbers, just not cached


def _changes(old: dict, new: dict) -> str:
    return ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in new if old.get(k) != new.get(k))


def _why_measure(cache: dict, ident: dict) -> str:
    """Why there is no valid stored entry: what changed since the closest one, if any."""
    same_place = [e for e in cache.values() if isinstance(e, dict) and isinstance(e.get("identity"), dict)
                  and e["identity"].get("device") == ident["device"] and e["identity"].get("dtype") == ident["dtype"]]
    if not same_place:
        return "no stored measurement for this device and dtype"
    latest = max(same_place, key=lambda e: e.get("measured_at", ""))
    return "changed since the stored measurement: " + _changes(latest["identity"], ident)


def _ridge(entry: dict) -> float:
    return round(entry["peak_matmul_gflops"] / entry["memory_bandwidth_gbs"], 1)


def roofline(device: str | torch.device = "cpu", refresh: bool = False, dtype: str = "float32",
             trials: int = TRIALS) -> dict:
    """{"device", "dtype", "peak_matmul_gflops", "memory_bandwidth_gbs", "ridge_flops_per_byte", "identity", ...}.

    Read from the cache when an entry for exactly this identity is there; measured (and stored)
    otherwise or with `refresh`, with the reason on stderr.
    """
    device = torch.device(device)
    ident = identity(device, dtype)
    key = _key(ident)
    cache = _read_cache()
    stored = cache.get(key)
    if not refresh and isinstance(stored, dict) and stored.get("identity") == ident and stored.get("peak_matmul_gflops"):
        return {**stored, "cached": True}
    why = "--refresh-roofline" if refresh else _why_measure(cache, ident)
    print(f"roofline: measuring {dtype} peak matmul and bandwidth ({why})", file=sys.stderr)
    peak = measure_peak_matmul_flops(device, dtype, trials)
    bandwidth = measure_memory_bandwidth(device, dtype, trials)
    entry = {
        "key": key, "device": str(device), "dtype": dtype, "identity": ident,
        "peak_matmul_gflops": round(peak / 1e9, 1),
        "memory_bandwidth_gbs": round(bandwidth / 1e9, 1),
        "peak_source": f"best of {trials} trials",
        "trials": trials,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    # FLOPs per byte at which a kernel turns from bandwidth- to compute-bound
    entry["ridge_flops_per_byte"] = _ridge(entry)
    _store(entry)
    return {**entry, "cached": False}


# ---- the one way to an MFU ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Bound:
    """One of the roofline's two measured bounds, as `_hold` keeps it."""
    field: str  # the roofline's key, in units of 1e9 per second
    unit: str
    name: str  # what it is, for the messages
    kind: str  # the rates it bounds, for the messages
    exceeding: str  # what a rate above it would make exceed 1
    measure: Callable[[torch.device, str, int], float]  # measures it afresh: (device, dtype, trials) -> per second
    source: str  # the key saying where the value came from
    raised_from: str  # the key keeping the value before an observed rate raised it


# The measuring functions are named at call time (not bound here), so a test's stand-in is the one called.
_PEAK = _Bound("peak_matmul_gflops", "GFLOP/s", "peak", "matmul", "MFU",
               lambda *args: measure_peak_matmul_flops(*args), "peak_source", "peak_raised_from_gflops")
_BANDWIDTH = _Bound("memory_bandwidth_gbs", "GB/s", "read bandwidth", "read", "a fraction of the read limit",
                    lambda *args: measure_memory_bandwidth(*args), "bandwidth_source", "bandwidth_raised_from_gbs")


def _hold(roof: dict, bound: _Bound, rate: float) -> bool:
    """Hold `bound` to an observed rate (per second): a rate above the stored value makes it be measured
    again (said on stderr); if the rate still beats the fresh measurement, it becomes the value. Updates
    `roof` in place and in the cache. Returns whether the value changed."""
    old = roof[bound.field]
    if rate <= old * 1e9:
        return False
    device, dtype = torch.device(roof.get("device", "cpu")), roof.get("dtype", "float32")
    shown = f"{rate / 1e9:.1f} {bound.unit}"
    print(f"roofline: observed {shown}, above the stored {dtype} {bound.name} of {old} {bound.unit} "
          f"({bound.exceeding} would exceed 1); measuring the {bound.name} again", file=sys.stderr)
    fresh = bound.measure(device, dtype, roof.get("trials", TRIALS))
    plausible = rate <= fresh * IMPLAUSIBLE_FACTOR
    raised = plausible and rate > fresh  # the observed rate becomes the value
    if not plausible:
        print(f"roofline: the observed {shown} is more than {IMPLAUSIBLE_FACTOR}x the fresh {fresh / 1e9:.1f} "
              f"{bound.unit}: not a {dtype} {bound.kind} rate (another precision's work, or work miscounted); "
              f"the {bound.name} stays measured, and no {bound.exceeding} is given for rates above it", file=sys.stderr)
    elif raised:
        print(f"roofline: the observed {shown} still beats the fresh {fresh / 1e9:.1f} {bound.unit} and becomes "
              f"the {bound.name} (a measured rate is a lower bound on it)", file=sys.stderr)
    else:
        print(f"roofline: new {bound.name} {fresh / 1e9:.1f} {bound.unit}", file=sys.stderr)
    best = max(fresh, old * 1e9, rate if raised else 0.0)
    roof[bound.field] = math.ceil(best / 1e8) / 10  # rounded up: the rate divided by it stays <= 1
    roof["ridge_flops_per_byte"] = _ridge(roof)
    roof[bound.source] = ("an observed rate above the measured value" if raised
                          else f"best of {roof.get('trials', TRIALS)} trials, re-measured")
    if raised:
        roof[bound.raised_from] = roof.get(bound.raised_from, old)
    roof["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    roof["cached"] = False
    if "key" in roof:
        _store(roof)
    return True


def observe(roof: dict, flops_per_s: float) -> bool:
    """Hold the roofline's peak to an observed matmul rate (`_hold`): MFU never exceeds 1."""
    return _hold(roof, _PEAK, flops_per_s)


def observe_bandwidth(roof: dict, bytes_per_s: float) -> bool:
    """Hold the roofline's read bandwidth to an observed read rate (`_hold`): no decode reads its bytes
    faster than its read limit."""
    return _hold(roof, _BANDWIDTH, bytes_per_s)


def mfu(roof: dict | None, work: Sequence[tuple[float, float]]) -> list[float | None]:
    """Model FLOPs utilisation of each (FLOPs, seconds): FLOPs / seconds / the peak.

    The one place an MFU is computed. The fastest rate of the lot is first held against the stored
    peak (`observe`), so every value returned is <= 1 and all of them use the same peak. Without a
    roofline every value is None, and so is the value of a rate still above the peak (one `observe`
    found implausible).
    """
    rates = [flops / seconds if seconds > 0 else math.inf for flops, seconds in work]
    if roof is None or not rates:
        return [None] * len(rates)
    finite = [r for r in rates if math.isfinite(r)]
    if finite:
        observe(roof, max(finite))
    peak = roof["peak_matmul_gflops"] * 1e9
    return [r / peak if r <= peak else None for r in rates]

def matmul_sweep(device: str | torch.device = "cpu", rows=(1, 8, 16, 32, 64, 71, 128, 256, 1024),
                 shape: tuple[int, int] = (22016, 4096), repeats: int = 5) -> list[dict]:
    """GFLOP/s of y = x @ W.T by batch rows, for plain F.linear and, on CPU, MKL's packed GEMM and
    the CPU kernels' panel GEMM, and which of them the engine's `Linear` runs at that row count."""
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
        if panels is not None:
            t = _best_time(lambda: cpu_kernels.linear(x, panels, n), device, repeats)
            row["panel_gflops"] = round(flops / t / 1e9, 1)
        row["engine_gemm"] = ("panel" if panels is not None and m <= cpu_kernels.max_rows()
                              else "packed" if packed is not None and m <= PACKED_GEMM_MAX_ROWS else "plain")
        out.append(row)
    return out


def decode_gemm_stream(device: str | torch.device = "cpu", rows: int = 16, layers: int = 30, hidden: int = 576,
                       intermediate: int = 1536, heads: int = 9, kv_heads: int = 3, vocab: int = 49152,
                       repeats: int = 5) -> list[dict]:
    """One decode step's linear layers, each GEMM with its own weight, so the weights stream from memory.

    Random weights with a model's layer shapes (QKV, O, gate/up, down per layer; the defaults are
    SmolLM2-135M's), `rows` batch rows, timed per GEMM backend: plain F.linear (MKL sgemm), MKL's
    packed GEMM (the engine's path above the panel kernel's rows, up to 64), the panel kernel (its path
    up to cpu_kernels.max_rows() rows) on fp32, bf16 and int8 weights, oneDNN's packed linear
    where torch has them, and where the CPU computes bf16, widened bf16's GEMMs on bf16 input
    (oneDNN's, the AMX tile kernel where there are tiles, the AVX512-BF16 kernel where it runs).
    `repeats` interleaved rounds (every backend once per round, after one round of warm-up): the
    layers' time and the LM head's ([vocab, hidden], as tied to the embedding) on its own, each a
    median with its spread, and from the medians the weight bytes read per second (of the weights as
    each backend stores them) and GFLOP/s. `compute` names the dtype each backend multiplies in
    (narrow weights on the panel kernel are widened to fp32), whose roofline its rate may raise.
    """
    device = torch.device(device)
    h, inter, head_dim = hidden, intermediate, hidden // heads
    shapes = [((heads + 2 * kv_heads) * head_dim, h), (h, heads * head_dim), (2 * inter, h), (h, inter)]
    weights = [torch.randn(n, k, device=device) * 0.02 for _ in range(layers) for n, k in shapes]
    inputs = {k: torch.randn(rows, k, device=device) for _, k in shapes}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flops = 2 * rows * nbytes / 4

    lm_head = torch.randn(vocab, h, device=device) * 0.02
    lm_input = torch.randn(rows, h, device=device)

    def run(prepare, call):
        prepared, head = [prepare(w) for w in weights], prepare(lm_head)
        return lambda: (_clocked(lambda: [call(inputs[w.shape[1]], p, w) for p, w in zip(prepared, weights)], device),
                        _clocked(lambda: call(lm_input, head, lm_head), device))

    backends = _stream_backends(device, rows)
    samples = interleaved({name: run(prepare, call) for name, prepare, call, _, _ in backends}, repeats, warmup=1)
    out = []
    for name, _, _, element_bytes, compute in backends:
        layer_times, head_times = [s[0] for s in samples[name]], [s[1] for s in samples[name]]
        t, t_head = median(layer_times), median(head_times)
        stored = nbytes // 4 * element_bytes
        # 3 significant digits: a small model's LM head takes a few microseconds, and its rates on a
        # busy machine can be a few MFLOP/s, which one decimal of GFLOP/s would round to 0
        out.append({"backend": name, "compute": compute, "rows": rows, "ms": _sig3(t * 1e3),
                    "ms" + SPREAD: [_sig3(x * 1e3) for x in spread(layer_times)], "weight_mb": round(stored / 1e6, 1),
                    "weight_gbs": _sig3(stored / t / 1e9), "gflops": _sig3(flops / t / 1e9),
                    "lm_head_ms": _sig3(t_head * 1e3),
                    "lm_head_ms" + SPREAD: [_sig3(x * 1e3) for x in spread(head_times)],
                    "lm_head_gbs": _sig3(lm_head.numel() * element_bytes / t_head / 1e9)})
    return out


def _stream_backends(device: torch.device, rows: int) -> list[tuple]:
    """decode_gemm_stream's backends that run here: (name, prepare(weight), call(x, prepared, weight),
    bytes per stored weight, the dtype it multiplies in)."""
    import torch.nn.functional as F

    from charioteer.model import cpu_kernels
    from charioteer.model.llama import PACKED_GEMM_MAX_ROWS, packed_gemm_available
    from charioteer.model.precision import native_bf16_linear, onednn_packs_bf16, pack_native_bf16, quantize_int8

    def int8_panels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = quantize_int8(w)
        return cpu_kernels.pack(q), scale

    out = [("F.linear", lambda w: None, lambda x, p, w: F.linear(x, w), 4, "float32")]
    if device.type == "cpu" and cpu_kernels.available():
        isa = cpu_kernels.chosen_isa()
        out.append((f"panel ({isa})", cpu_kernels.pack, lambda x, p, w: cpu_kernels.linear(x, p, w.shape[0]), 4,
                    "float32"))
        out.append((f"panel bf16 ({isa})", lambda w: cpu_kernels.pack(w.bfloat16()),
                    lambda x, p, w: cpu_kernels.linear(x, p, w.shape[0]), 2, "float32"))
        out.append((f"panel int8 ({isa})", int8_panels,
                    lambda x, p, w: cpu_kernels.linear(x, p[0], w.shape[0], p[1]), 1, "float32"))
    if packed_gemm_available(device):
        out.append(("mkl packed", lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, PACKED_GEMM_MAX_ROWS),
                    lambda x, p, w: torch.ops.mkl._mkl_linear(x, p, w, None, rows), 4, "float32"))
    if (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))):
        out.append(("onednn packed", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, rows),
                    lambda x, p, w: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), 4, "float32"))
    # widened bf16's GEMMs where the CPU computes bf16 (NarrowLinear): x rounded to bf16 at each call
    if device.type == "cpu" and onednn_packs_bf16():
        out.append(("onednn packed bf16", lambda w: pack_native_bf16(w.bfloat16()),
                    lambda x, p, w: native_bf16_linear(x.bfloat16(), p), 2, "bfloat16"))
    if device.type == "cpu" and cpu_kernels.amx_available():
        out.append(("amx tiles bf16", lambda w: cpu_kernels.amx_pack(w.bfloat16()),
                    lambda x, p, w: cpu_kernels.amx_linear(x.bfloat16(), p, w.shape[0], bf16_output=True), 2,
                    "bfloat16"))
    if device.type == "cpu" and cpu_kernels.avx512_bf16_unavailable_reason() is None:
        out.append(("avx512-bf16 bf16", lambda w: cpu_kernels.amx_pack(w.bfloat16()),
                    lambda x, p, w: cpu_kernels.avx512_bf16_linear(x.bfloat16(), p, w.shape[0], bf16_output=True), 2,
                    "bfloat16"))
    if device.type == "cpu" and cpu_kernels.vnni_unavailable_reason() is None:  # x in int16 per 128 values
        out.append(("vnni int8", int8_panels, lambda x, p, w: cpu_kernels.vnni_linear_int8(x, p[0], w.shape[0], p[1]),
                    1, "float32"))
    return out


# (name, query heads, KV heads, head_dim, [(chunk tokens, start position)]) of bench roofline --attention
ATTENTION_SHAPES = (("SmolLM2-135M", 9, 3, 64, ((37, 300), (128, 896), (256, 0), (256, 768), (512, 0), (512, 512))),
                    ("LLaMA-7B", 32, 32, 128, ((17, 238), (49, 0), (49, 196), (113, 113), (256, 0), (128, 1024))))


def prefill_attention_sweep(dtype: str = "float32", repeats: int = 5) -> list[dict]:
    """A prompt chunk's attention per backend the engine may run it on (the model's `_prefill_attention`):
    torch's SDPA as the engine calls it (causal for a first chunk, an explicit mask after), the CPU
    kernels' vectors in fp32 products, and in bf16 products for bf16 where AVX512-BF16 runs, and AMX
    tiles where they run; q, K and V random in `dtype` (the AMX kernel's q in bf16). `repeats`
    interleaved rounds after one warm-up round; per shape and backend the median time with its
    spread, and GFLOP/s of the causal pairs (4 x heads x dim FLOPs each)."""
    import torch.nn.functional as F

    from charioteer.model import cpu_kernels

    def sdpa(q, k, v, start):
        n, keys = q.shape[0], k.shape[0]
        mask = None if start == 0 else torch.ones(n, keys, dtype=torch.bool).tril(start)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, is_causal=start == 0, enable_gqa=True)
        return o[0].transpose(0, 1)

    backends = {"sdpa": sdpa}
    if cpu_kernels.available():
        backends[f"vector ({cpu_kernels.chosen_isa()})"] = (
            lambda q, k, v, start: cpu_kernels.prefill_attention(q, k, v, start, q.shape[-1] ** -0.5))
    if dtype == "bfloat16" and cpu_kernels.avx512_bf16_unavailable_reason() is None:
        backends["vector bf16 products"] = lambda q, k, v, start: cpu_kernels.prefill_attention(
            q, k, v, start, q.shape[-1] ** -0.5, bf16_products=True, isa="avx512")
    if cpu_kernels.amx_available():
        backends["amx tiles"] = lambda q, k, v, start: cpu_kernels.amx_prefill_attention(
            q.bfloat16(), k.bfloat16(), v.bfloat16(), start, q.shape[-1] ** -0.5)
    out = []
    for model, heads, kv_heads, dim, chunks in ATTENTION_SHAPES:
        for n, start in chunks:
            q = torch.randn(n, heads, dim).to(DTYPES[dtype])
            k, v = (torch.randn(start + n, kv_heads, dim).to(DTYPES[dtype]) for _ in range(2))
            runs = {name: (lambda fn=fn: _clocked(lambda: fn(q, k, v, start))) for name, fn in backends.items()}
            samples = interleaved(runs, repeats, warmup=1)
            flops = 4 * heads * dim * (n * start + n * (n + 1) / 2)
            for name, times in samples.items():
                t = median(times)
                out.append({"model": model, "tokens": n, "start": start, "backend": name, "ms": _sig3(t * 1e3),
                            "ms" + SPREAD: [_sig3(x * 1e3) for x in spread(times)], "gflops": _sig3(flops / t / 1e9),
                            "sdpa_over": _sig3(median(samples["sdpa"]) / t)})
    return out


# (name, query heads, KV heads, head_dim, [(decodes, context tokens)]) of bench roofline --decode-attention; one
# long context is spread over the threads by its chunks (cpu_kernels.decode_attention_chunk)
DECODE_ATTENTION_SHAPES = (("SmolLM2-135M", 9, 3, 64, ((1, 256), (1, 4096), (16, 600))),
                           ("LLaMA-7B", 32, 32, 128, ((1, 512), (16, 512))))
COLD_CACHE_MB = 1024  # K/V read per timed call set: beyond any last-level cache here (the Xeon's is 480 MB)


def decode_attention_stream(dtype: str = "float32", repeats: int = 5, cache_mb: float = COLD_CACHE_MB,
                            shapes=DECODE_ATTENTION_SHAPES) -> list[dict]:
    """Decode attention (`cpu_kernels.decode_attention`, every decode step's and mixed batch's) reading its
    K/V from memory, as at a decode step, where every weight has streamed through the caches since.
    Per shape, copies of a layer's caches (contiguous contexts, `dtype`) until `cache_mb` MB, one call on
    each per timed set; `repeats` interleaved rounds (after one warm-up), each with a trial of the read
    bandwidth (`bandwidth_reader`, the GEMV over 512 MB that the single-stream limits use) beside them.
    Per shape the median call with its spread, the K/V bytes read per second, and that rate over the
    median bandwidth of the same rounds (`of_read`). Empty without the CPU kernels."""
    from charioteer.model import cpu_kernels

    if not cpu_kernels.available():
        return []
    dt = _dtype(dtype)
    read = bandwidth_reader("cpu", dtype)
    runs, sizes = {"read": lambda: read(1)}, {}
    for model, heads, kv_heads, dim, cases in shapes:
        for decodes, context in cases:
            layer = torch.randn(2, decodes * context, kv_heads, dim).to(dt)
            copies = max(1, math.ceil(cache_mb * 1e6 / (layer.numel() * layer.element_size())))
            caches = torch.empty(copies, *layer.shape, dtype=dt)
            caches.copy_(layer.expand_as(caches))  # a copy, not randn: 1 GB of randn takes seconds
            slots = torch.arange(decodes * context).view(decodes, context)
            lengths = torch.full((decodes,), context, dtype=torch.long)
            q, out = torch.randn(decodes, heads, dim), torch.empty(decodes, heads, dim)

            def calls(caches=caches, slots=slots, lengths=lengths, q=q, out=out):
                for kv in caches:
                    cpu_kernels.decode_attention(q, kv[0], kv[1], slots, lengths, dim ** -0.5, out)

            runs[(model, decodes, context)] = lambda calls=calls: _clocked(calls)
            sizes[(model, decodes, context)] = (copies, caches.numel() * caches.element_size())
    samples = interleaved(runs, repeats, warmup=1)
    read_gbs = median(samples.pop("read")) / 1e9
    out = []
    for (model, decodes, context), times in samples.items():
        copies, nbytes = sizes[(model, decodes, context)]
        t = median(times)
        out.append({"model": model, "decodes": decodes, "context": context, "cache": dtype,
                    "us_per_call": _sig3(t / copies * 1e6), "us_per_call" + SPREAD: [_sig3(x / copies * 1e6)
                                                                                    for x in spread(times)],
                    "kv_gbs": _sig3(nbytes / t / 1e9), "read_gbs": _sig3(read_gbs),
                    "of_read": round(nbytes / t / 1e9 / read_gbs, 2)})
    return out


def describe(r: dict) -> str:
    ident = r.get("identity") or {}
    where = ", ".join(str(x) for x in (
        r.get("device"), ident.get("processor"), "+".join(ident.get("features") or []) or None, ident.get("isa"),
        f"{ident['threads']} threads" if ident.get("threads") else None, f"torch {ident.get('torch')}",
        "cached" if r.get("cached") else None) if x)
    raised = (f", raised from {r['peak_raised_from_gflops']} GFLOP/s by an observed rate"
              if r.get("peak_raised_from_gflops") is not None else "")
    return (f"roofline: peak {r.get('dtype', 'float32')} matmul {r['peak_matmul_gflops']:.0f} GFLOP/s{raised}, "
            f"memory bandwidth {r['memory_bandwidth_gbs']:.1f} GB/s, ridge {r['ridge_flops_per_byte']:.0f} FLOP/byte "
            f"({where})")
