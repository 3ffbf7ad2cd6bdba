"""Prefix caching: full KV blocks remembered by the tokens that led to them.

A block's key is (the previous block's key hash, the block's own tokens), so two requests share
block i only when their first (i + 1) * block_size tokens are equal. Token tuples are compared
exactly; only the chain of previous blocks is compared by its 64-bit hash.

A cached block is in one of two states. Blocks that some request holds are shared: a new request
whose prompt starts with the same tokens takes them and skips their prefill. Blocks that no
request holds any more stay in the cache, least recently used first, and are only handed out as
new blocks (their key forgotten) when the free list runs dry.
"""
from __future__ import annotations

from collections import OrderedDict

BlockKey = tuple[int, tuple[int, ...]]


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._block_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._unused: OrderedDict[int, None] = OrderedDict()  # cached blocks no request holds, LRU first
        self.queries = 0  # tokens looked up at admission (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found in the cache

    @property
    def num_unused(self) -> int:
        return len(self._unused)

    def keys(self, tokens: list[int], known: list[BlockKey]) -> list[BlockKey]:
        """The keys of every full block of `tokens`, extending `known` (the keys of a prefix)."""
        bs = self.block_size
        for i in range(len(known), len(tokens) // bs):
            parent = hash(known[-1]) if known else 0
            known.append((parent, tuple(tokens[i * bs:(i + 1) * bs])))
        return known

    def lookup(self, keys: list[BlockKey]) -> list[int]:
        """The cached blocks of the longest cached prefix of `keys`."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def is_unused(self, block: int) -> bool:
        return block in self._unused

    def take(self, block: int) -> None:
        """A request holds `block` again."""
        self._unused.pop(block, None)

    def register(self, key: BlockKey, block: int) -> None:
        """`block` now holds the KV of `key` (written and complete). The first block with a key keeps it."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def release(self, block: int) -> bool:
        """No request holds `block` any more: keep it as unused if cached. False: it is plain free."""
        if block not in self._key_of:
            return False
        self._unused[block] = None
        return True

    def evict(self) -> int:
        """Forget the least recently released unused block and return it for reuse."""
        block, _ = self._unused.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block
