"""The packed weights in one block of memory on 2 MB pages (Linux's transparent huge pages).

A decode step streams every packed weight once, matrix after matrix. On 4 KB pages it takes a TLB
miss and a page walk every 4 KB; on 2 MB pages one every 2 MB. Torch puts a tensor on huge pages
only where the system gives them to every allocation or THP_MEM_ALLOC_ENABLE is set, and then only
tensors of 2 MB or more, while most of a small model's matrices are smaller (SmolLM2's attention
weights are 0.7-1.1 MB in bf16). So the model copies all of its packed weights into one arena, a fresh
mapping that it asks the kernel (madvise MADV_HUGEPAGE) to back with huge pages before touching it
(memory from the allocator may have been touched before, on 4 KB pages, and stays on them). On a Zen 4 with
SmolLM2 that made one stream's decode step 1.05-1.23x faster (BENCHMARKS.md). CHARIOTEER_HUGE_PAGES=0
keeps each weight where it was made.
"""
from __future__ import annotations

import mmap
import sys

import torch

from charioteer.runtime import switched_on

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # each weight's offset in the arena: a cache line, as torch aligns its own


def enabled() -> bool:
    """Whether weights go into a huge-page arena: Linux, and CHARIOTEER_HUGE_PAGES is not 0."""
    return sys.platform.startswith("linux") and switched_on("CHARIOTEER_HUGE_PAGES")


def _fresh_huge_mapping(nbytes: int) -> torch.Tensor | None:
    """An untouched anonymous mapping of `nbytes`, advised onto huge pages, as a uint8 tensor that keeps it
    alive; None where the system refuses either."""
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError, ValueError):
        return None
    return torch.frombuffer(region, dtype=torch.uint8)


def into_arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, contiguous) side by side in one buffer advised onto huge pages, each at a
    cache-line offset; the copies keep the buffer alive. Where that cannot be done (not enabled, not Linux,
    madvise refused, a tensor not on the CPU), the tensors themselves."""
    if not tensors or not enabled() or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return tensors
    sizes = [-(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT for t in tensors]
    buffer = _fresh_huge_mapping(sum(sizes) + HUGE_PAGE)
    if buffer is None:
        return tensors
    first = -buffer.data_ptr() % HUGE_PAGE  # the first 2 MB boundary inside the mapping
    copies, offset = [], first
    for t, size in zip(tensors, sizes):
        nbytes = t.numel() * t.element_size()
        copy = buffer[offset:offset + nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
        offset += size
    return copies
