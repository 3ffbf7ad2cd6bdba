"""How a model is split over devices: pipeline stages (layers) and tensor-parallel ranks (heads).

One copy of each rule, shared by the pipeline executor (which runs the split) and the simulator
(which prices it). Torch-free.
"""
from __future__ import annotations


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges, as even as possible (earlier stages take the remainder)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"pipeline stages (pipeline_parallel_size, pp) must be between 1 and the model's "
                         f"{num_layers} layers, got {num_stages}")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        end = start + base + (s < extra)
        ranges.append((start, end))
        start = end
    return ranges


def layers_per_stage(num_layers: int, num_stages: int) -> list[int]:
    """How many layers each stage of `split_layers` holds."""
    return [end - start for start, end in split_layers(num_layers, num_stages)]


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one of `tp` tensor-parallel ranks holds: a share, or one replicated head when tp > kv heads (GQA)."""
    return max(1, num_kv_heads // tp)
