"""KV-cache accounting: which cache blocks each request owns.

The executor owns the KV tensors (num_blocks * block_size slots per layer); this module only
decides which slots belong to whom, so the simulator can use it without any tensors.

Two policies:
- `paged` (default): blocks are taken on demand as a request grows, as in vLLM.
- `reserve`: the paper's policy; at admission a request reserves room for its maximum length
  (prompt + max_tokens), so it can never run out later and is never preempted.

A block may be held by several requests (a reference count per block): with prefix caching
(`memory/prefix_cache.py`, paged only) a request starts with the cached blocks of its prompt's
longest cached prefix; the samples of an `n > 1` request start on the prompt blocks that its
sample 0 computed. Shared blocks are always full, so nobody writes them again.
"""
from __future__ import annotations

import bisect

import numpy as np

from charioteer.memory.prefix_cache import BlockKey, PrefixCache
from charioteer.request import Request

KV_POLICIES = ("paged", "reserve")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, policy: str = "paged", prefer_contiguous: bool = False,
                 enable_prefix_caching: bool = False) -> None:
        """`prefer_contiguous`: hand a request consecutive block ids where possible (the lowest free
        run that fits; a growing request its next block), so its K/V is one run of cache rows that
        attention reads in place. It costs a scan of the free list per admission, so the simulator,
        which has no tensors, keeps the plain stack."""
        if policy not in KV_POLICIES:
            raise ValueError(f"unknown kv_policy {policy!r}: choose one of {', '.join(KV_POLICIES)}")
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if enable_prefix_caching and policy == "reserve":
            raise ValueError(PREFIX_CACHING_WITH_RESERVE)
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
        self._refs = [0] * num_blocks  # requests holding each block
        self.prefix_cache = PrefixCache(block_size) if enable_prefix_caching else None
        self._keys: dict[str, list[BlockKey]] = {}  # request_id -> keys of its full blocks, memoized
        self._num_registered: dict[str, int] = {}  # request_id -> its leading blocks already in the cache

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request may take: free ones and cached ones that no request holds."""
        return len(self._free) + (self.prefix_cache.num_unused if self.prefix_cache else 0)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def block_table(self, request: Request) -> list[int]:
        return self._tables.get(request.request_id, [])

    def can_admit(self, request: Request, first_tokens: int) -> bool:
        """Whether a waiting request can start with `first_tokens` tokens in its first batch."""
        hits = self._shared_prefix(request)
        if self.policy == "reserve":
            return cdiv(request.max_num_tokens, self.block_size) - len(hits) <= len(self._free)
        cached = len(hits) * self.block_size
        first = min(first_tokens, request.num_tokens - cached)
        unused_hits = sum(1 for block in hits if self._refs[block] == 0)  # taking them shrinks the pool
        return cdiv(cached + first, self.block_size) - len(hits) + unused_hits <= self.num_free_blocks

    def fits_ever(self, request: Request) -> bool:
        """Whether the request could run at all with the whole cache to itself."""
        return cdiv(request.max_num_tokens, self.block_size) <= self.num_blocks

    def admit(self, request: Request, first_tokens: int) -> int:
        """Give a waiting request its block table. Returns how many of its first tokens are already
        in the cache (whole blocks of a cached prefix), which it need not compute."""
        rid = request.request_id
        assert rid not in self._tables, f"{rid} already holds blocks"
        hits = self._shared_prefix(request)
        for block in hits:
            self._hold(block)
        self._tables[rid] = list(hits)
        self._num_registered[rid] = len(hits)
        if self.prefix_cache is not None and request.params.prompt_logprobs is None:
            self.prefix_cache.queries += request.num_tokens
            self.prefix_cache.hits += len(hits) * self.block_size
        if self.policy == "reserve":
            self._grow(request, cdiv(request.max_num_tokens, self.block_size) - len(hits))
        return len(hits) * self.block_size

    def ensure(self, request: Request, num_tokens: int) -> bool:
        """Make positions [0, num_tokens) addressable. Returns False (changing nothing) if out of blocks."""
        missing = self._missing(request, num_tokens)
        if missing <= 0:
            return True
        if self.policy == "reserve":
            held = len(self._tables[request.request_id])
            raise RuntimeError(f"{request.request_id} grew past its reserved {held} blocks")
        if missing > self.num_free_blocks:
            return False
        self._grow(request, missing)
        return True

    def ensure_all(self, wanted: list[tuple[Request, int]]) -> bool:
        """`ensure` for every (request, num_tokens), all or none: False (changing nothing) if out of blocks."""
        if sum(max(0, self._missing(request, n)) for request, n in wanted) > self.num_free_blocks:
            return False
        for request, n in wanted:
            if not self.ensure(request, n):
                raise AssertionError("the free blocks were counted")
        return True

    def _missing(self, request: Request, num_tokens: int) -> int:
        """Blocks `request` lacks for positions [0, num_tokens) (negative: it holds more)."""
        return cdiv(num_tokens, self.block_size) - len(self._tables[request.request_id])

    # ---- sharing ------------------------------------------------------------------------

    def _shared_prefix(self, request: Request) -> list[int]:
        """Blocks a waiting request may start on, leaving at least its last token to compute (for
        its logits): its longest cached prefix, or else the full blocks of its prompt that its
        sample 0 (`fork_of`) has computed. None for a request that wants prompt logprobs, since
        shared positions are never computed for it."""
        if request.params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        if self.prefix_cache is not None:
            return self.prefix_cache.lookup(self._block_keys(request, (request.num_tokens - 1) // bs * bs))
        leader = request.fork_of
        if leader is None or leader.request_id not in self._tables:
            return []
        num = min(leader.num_computed_tokens, request.num_prompt_tokens, request.num_tokens - 1) // bs
        return self._tables[leader.request_id][:num]

    def _block_keys(self, request: Request, num_tokens: int) -> list[BlockKey]:
        """The prefix-cache keys of the request's full blocks within its first `num_tokens` tokens."""
        known = self._keys.setdefault(request.request_id, [])
        if len(known) < num_tokens // self.block_size:
            self.prefix_cache.keys(request.token_slice(0, num_tokens), known)
        return known[:num_tokens // self.block_size]

    def cache_computed(self, request: Request) -> None:
        """Offer the request's newly completed full blocks to the prefix cache (call once the batch
        that wrote them has returned)."""
        if self.prefix_cache is None:
            return
        rid = request.request_id
        done, full = self._num_registered.get(rid, 0), request.num_computed_tokens // self.block_size
        if full <= done or rid not in self._tables:
            return
        keys, table = self._block_keys(request, full * self.block_size), self._tables[rid]
        for i in range(done, full):
            self.prefix_cache.register(keys[i], table[i])
        self._num_registered[rid] = full

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0 and self.prefix_cache is not None:
            self.prefix_cache.take(block)
        self._refs[block] += 1

    def _reclaim(self, n: int) -> None:
        """Evict least recently used cached blocks until `n` blocks are free."""
        while len(self._free) < n and self.prefix_cache is not None:
            block = self.prefix_cache.evict()
            if self.prefer_contiguous:
                bisect.insort(self._free, block)
            else:
                self._free.append(block)

    def _grow(self, request: Request, n: int) -> None:
        table = self._tables[request.request_id]
        self._reclaim(n)
        if not self.prefer_contiguous:
            for _ in range(n):
                block = self._free.pop()
                self._refs[block] = 1
                table.append(block)
            return
        free = self._free  # ascending
        nxt = table[-1] + 1 if table else -1
        i = bisect.bisect_left(free, nxt)
        if table and free[i:i + n] == list(range(nxt, nxt + n)):
            start = i  # right after the request's last block: its rows stay one run
        else:
            start = self._place(request, n, len(table))
        table.extend(free[start:start + n])
        for block in free[start:start + n]:
            self._refs[block] = 1
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
        """The request lets go of its blocks (finished or preempted). A block nobody holds becomes
        free, or stays cached as unused with prefix caching; the request's last blocks are
        released first, so they are evicted before the prefix that others may share."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        for memo in (self._room_end, self._keys, self._num_registered):
            memo.pop(rid, None)
        for block in reversed(table or ()):
            self._refs[block] -= 1
            if self._refs[block] or (self.prefix_cache is not None and self.prefix_cache.release(block)):
                continue
            if self.prefer_contiguous:
                bisect.insort(self._free, block)
            else:
                self._free.append(block)


PREFIX_CACHING_WITH_RESERVE = ("prefix caching shares KV blocks on demand, but kv_policy 'reserve' reserves each "
                               "request's blocks at admission: use kv_policy 'paged' or turn prefix caching off")


# The paper's memory arithmetic (section 4.3.1), shared by the engine, `charioteer tune` and the
# simulator's memory planner (per device: pass one stage's layers and one TP rank's KV heads).

def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """m_kv in the paper: bytes of K and V for one token across `num_layers` layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def batch_capacity(memory_bytes: int, weight_bytes: int, max_seq_len: int, kv_token_bytes: int) -> int:
    """The paper's section 4.3.1: B = floor((M_G - M_S) / (L * m_kv)), requests of length L whose KV fits."""
    return max(0, (memory_bytes - weight_bytes) // (max_seq_len * kv_token_bytes))
