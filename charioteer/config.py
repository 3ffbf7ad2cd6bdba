"""Configuration dataclasses, validated once when built."""
from __future__ import annotations

from dataclasses import dataclass

from charioteer.memory.block_manager import KV_POLICIES

SCHEDULERS = ("sarathi", "orca", "vllm", "request-level")


@dataclass
class SchedulerConfig:
    policy: str = "sarathi"
    max_num_seqs: int = 32  # the batch cap B: requests running at once
    chunk_size: int | str = 256  # C, for sarathi; "auto" follows the P:D of recent requests
    min_chunk_size: int = 16  # bounds of C under chunk_size="auto"
    max_chunk_size: int = 512
    tune_table: str | None = None  # chunk_size="auto": a table from `charioteer tune --save-table`
    max_num_batched_tokens: int | None = None  # token budget per batch; None = no budget
    tile_size: int | None = None  # sarathi: shrink C so that C + decodes is a multiple of this
    token_budget_mode: bool = False  # sarathi: decodes first, then fill the budget with chunks

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.policy!r}: choose one of {', '.join(SCHEDULERS)}")
        if self.chunk_size == "auto":
            if self.policy != "sarathi":
                raise ValueError(f"chunk_size='auto' is for the sarathi scheduler, not {self.policy}")
            if not 1 <= self.min_chunk_size <= self.max_chunk_size:
                raise ValueError(f"need 1 <= min_chunk_size <= max_chunk_size, got {self.min_chunk_size}, {self.max_chunk_size}")
        elif not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1 or 'auto', got {self.chunk_size!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.tile_size is not None and self.tile_size < 1:
            raise ValueError(f"tile_size must be >= 1, got {self.tile_size}")
        if self.token_budget_mode and self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = self.max_chunk_size if self.chunk_size == "auto" else self.chunk_size


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_policy: str = "paged"
    num_blocks: int | None = None  # None: derive from memory_bytes
    memory_bytes: int = 2 << 30  # KV budget when num_blocks is None

    def __post_init__(self) -> None:
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"unknown kv_policy {self.kv_policy!r}: choose one of {', '.join(KV_POLICIES)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_bytes < 1:
            raise ValueError(f"memory_bytes must be >= 1, got {self.memory_bytes}")
