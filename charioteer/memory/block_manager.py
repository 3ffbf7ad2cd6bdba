"""KV-cache accounting: which cache blocks each request owns.

The executor owns the KV tensors (num_blocks * block_size slots per layer); this module only
decides which slots belong to whom, so the simulator can use it without any tensors.

Two policies:
- `paged` (default): blocks are taken on demand as a request grows, as in vLLM.
- `reserve`: the paper's policy; at admission a request reserves room for its maximum length
  (prompt + max_tokens), so it can never run out later and is never preempted.
"""
from __future__ import annotations

import bisect

import numpy as np

from charioteer.request import Request

KV_POLICIES = ("paged", "reserve")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, policy: str = "paged", prefer_contiguous: bool = False) -> None:
        """`prefer_contiguous`: hand a request consecutive block ids where possible (the lowest free
        run that fits; a growing request its next block), so its K/V is one run of cache rows that
        attention reads in place. It costs a scan of the free list per admission, so the simulator,
        which has no tensors, keeps the plain stack."""
        if policy not in KV_POLICIES:
            raise ValueError(f"unknown kv_policy {policy!r}: choose one of {', '.join(KV_POLICIES)}")
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.policy = policy
        # Free block ids: a stack whose pops give 0, 1, 2, ... on a fresh cache (recently freed
        # blocks come back first, warm); with prefer_contiguous, an ascending list.
        self.prefer_contiguous = prefer_contiguous
        self._free: list[int] = list(range(num_blocks)) if prefer_contiguous else list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        # prefer_contiguous, paged: the block id each request may grow up to (exclusive). Other
        # requests are placed outside that room while space allows, so a request that fills its
        # prompt and then decodes block by block stays one run instead of hitting its neighbour.
        self._room_end: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def block_table(self, request: Request) -> list[int]:
        return self._tables.get(request.request_id, [])

    def _blocks_to_admit(self, request: Request, first_tokens: int) -> int:
        if self.policy == "reserve":
            return cdiv(request.max_num_tokens, self.block_size)
        return cdiv(first_tokens, self.block_size)

    def can_admit(self, request: Request, first_tokens: int) -> bool:
        """Whether a waiting request can start with `first_tokens` tokens in its first batch."""
        return self._blocks_to_admit(request, first_tokens) <= len(self._free)

    def fits_ever(self, request: Request) -> bool:
        """Whether the request could run at all with the whole cache to itself."""
        return cdiv(request.max_num_tokens, self.block_size) <= self.num_blocks

    def admit(self, request: Request, first_tokens: int) -> None:
        assert request.request_id not in self._tables, f"{request.request_id} already holds blocks"
        self._tables[request.request_id] = []
        if self.policy == "reserve":
            self._grow(request, self._blocks_to_admit(request, first_tokens))

    def ensure(self, request: Request, num_tokens: int) -> bool:
        """Make positions [0, num_tokens) addressable. Returns False (changing nothing) if out of blocks."""
        table = self._tables[request.request_id]
        missing = cdiv(num_tokens, self.block_size) - len(table)
        if missing <= 0:
            return True
        if self.policy == "reserve":
            raise RuntimeError(f"{request.request_id} grew past its reserved {len(table)} blocks")
        if missing > len(self._free):
            return False
        self._grow(request, missing)
        return True

    def _grow(self, request: Request, n: int) -> None:
        table = self._tables[request.request_id]
        if not self.prefer_contiguous:
            for _ in range(n):
                table.append(self._free.pop())
            return
        free = self._free  # ascending
        nxt = table[-1] + 1 if table else -1
        i = bisect.bisect_left(free, nxt)
        if table and free[i:i + n] == list(range(nxt, nxt + n)):
            start = i  # right after the request's last block: its rows stay one run
        else:
            start = self._place(request, n, len(table))
        table.extend(free[start:start + n])
        del free[start:start + n]
        if self.policy == "paged":
            self._room_end[request.request_id] = table[-1] + 1 + max(
                0, cdiv(request.max_num_tokens, self.block_size) - len(table))

    def _place(self, request: Request, n: int, held: int) -> int:
        """Index in the free list where `n` new blocks for `request` start.

        In order: the lowest run that also holds the request's remaining room (paged: up to its
        maximum length) outside other requests' rooms; the lowest run of n outside them; the lowest
        run of n anywhere; the n lowest blocks.
        """
        free = self._free
        ids = np.asarray(free)
        outside = np.ones(len(ids), dtype=bool)
        for rid, end in self._room_end.items():
            if rid != request.request_id:
                lo, hi = np.searchsorted(ids, [self._tables[rid][-1] + 1, end])
                outside[lo:hi] = False
        blocked = np.concatenate(([0], np.cumsum(~outside)))  # blocked[j]: room blocks among ids[:j]
        want = max(n, cdiv(request.max_num_tokens, self.block_size) - held) if self.policy == "paged" else n
        for length, respect_rooms in ((want, True), (n, True), (n, False)):
            if length > len(ids):
                continue
            consecutive = ids[length - 1:] - ids[:len(ids) - length + 1] == length - 1
            if respect_rooms:
                consecutive &= blocked[length:] == blocked[:len(blocked) - length]
            runs = np.flatnonzero(consecutive)
            if runs.size:
                return int(runs[0])
        return 0

    def free(self, request: Request) -> None:
        table = self._tables.pop(request.request_id, None)
        self._room_end.pop(request.request_id, None)
        if not table:
            return
        if self.prefer_contiguous:
            for block in table:
                bisect.insort(self._free, block)
        else:
            self._free.extend(reversed(table))


# The paper's memory arithmetic (section 4.3.1), shared by the engine, `charioteer tune` and the
# simulator's memory planner (per device: pass one stage's layers and one TP rank's KV heads).

def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """m_kv in the paper: bytes of K and V for one token across `num_layers` layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def batch_capacity(memory_bytes: int, weight_bytes: int, max_seq_len: int, kv_token_bytes: int) -> int:
    """The paper's section 4.3.1: B = floor((M_G - M_S) / (L * m_kv)), requests of length L whose KV fits."""
    return max(0, (memory_bytes - weight_bytes) // (max_seq_len * kv_token_bytes))
