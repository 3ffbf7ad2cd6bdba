"""Process-wide settings that make the CPU hot path fast.

glibc's malloc serves large blocks (from 128 KB, adjusting upwards) with mmap and gives freed
memory back to the OS. Every step of the engine allocates and frees the same few large
activation tensors (a 64-token gate/up output of LLaMA-7B is 5.6 MB; a decode KV gather tens of
MB), so each step paid page faults and kernel page zeroing for all of them: measured here, a
32 MB KV gather took 24 ms that way and 9.7 ms from a heap that keeps its memory. We raise
the mmap threshold to 1 GiB and stop trimming, as inference servers commonly do with their
allocator. Weights and the KV cache (larger than that, or allocated once) are unaffected.
mallopt takes a C int: a trim threshold past 2**31 - 1 wraps (1 << 40 became 0, which trims on every
free and cost a 2048-row step 3000 page faults in one gate/up GEMM), so the largest int is the setting.
Set CHARIOTEER_MALLOC_TUNING=0 to leave malloc alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1
_done = False


def switched_on(name: str) -> bool:
    """A fast path's environment switch: on unless `name`=0, which forces the portable path (so that tests run
    it on any machine)."""
    return os.environ.get(name, "1") != "0"


def binary_switch(name: str, default: bool) -> bool:
    """An environment switch that must be 0 or 1 (`default` where unset); any other value is refused."""
    setting = os.environ.get(name, "1" if default else "0").strip()
    if setting not in ("0", "1"):
        raise ValueError(f"{name}={setting} is neither 0 nor 1")
    return setting == "1"


def switched_off_reason(name: str) -> str | None:
    """The reason "disabled by NAME=0" where the switch `name` is off, else None."""
    return None if switched_on(name) else f"disabled by {name}=0"


def tune_allocator() -> bool:
    """Apply the malloc settings once per process; False where they do not apply (not glibc, opted out)."""
    global _done
    if _done:
        return True
    if not switched_on("CHARIOTEER_MALLOC_TUNING"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
    _done = ok
    return ok


def available_memory_bytes() -> int | None:
    """The memory the kernel says a new allocation can take without swapping (MemAvailable), or None where
    /proc/meminfo does not tell (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
