"""KV block bookkeeping (no tensors): which pages of the pool belong to whom, and which hold a cached prefix."""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


def block_key(parent: bytes, token_ids: Sequence[int], scope: str) -> bytes:
    """The cache key of one full block: a hash chain over the parent block's key, the block's
    tokens and the isolation scope, so equal keys mean the same tokens from position 0 on, seen
    by the same scope. SHA-256 (truncated): a client cannot craft a collision with another
    tenant's prefix."""
    h = hashlib.sha256(parent)
    h.update(scope.encode())
    h.update(b"\0")
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return h.digest()[:16]


class BlockAllocator:
    """Reference-counted allocator over `num_blocks` KV pages, with a prefix cache.

    A block with owners has a reference count of at least 1 and is never reused. At count 0 it
    is free, or, if it holds a cached full block (`cache`), *evictable*: it keeps its K/V and
    key in an LRU that allocation takes from only when the free list is empty. `lookup` hands
    out references to cached blocks again. Cached blocks are immutable: a key is registered
    only for a block whose every slot holds committed K/V, and owners write only past those.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # count 0, cached; oldest first
        self._key_of: dict[int, bytes] = {}  # cached block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> cached block

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_of)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by owners (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` slots."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:  # the least recently used cached block gives up its prefix
                b, _ = self._evictable.popitem(last=False)
                del self._block_of[self._key_of.pop(b)]
            self._ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def fork(self, blocks: list[int]) -> list[int]:
        """Share `blocks` with another owner (one more reference each)."""
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise ValueError(f"cannot share free block {b}")
            self._ref_counts[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; at 0 it is free, or evictable if cached."""
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise ValueError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                if b in self._key_of:
                    self._evictable[b] = None  # most recently used last
                else:
                    self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # ---- prefix cache ------------------------------------------------------------------------

    def cache(self, block: int, key: bytes) -> None:
        """Register an owned, full, committed block under `key`. A key already cached elsewhere
        (two requests computed the same prefix at once) keeps its first block."""
        if self._ref_counts[block] < 1:
            raise ValueError(f"cannot cache free block {block}")
        if key in self._block_of or block in self._key_of:
            return
        self._key_of[block] = key
        self._block_of[key] = block

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Take a reference to each block of the longest cached run of `keys` from the first."""
        blocks = []
        for key in keys:
            b = self._block_of.get(key)
            if b is None:
                break
            if self._ref_counts[b] == 0:
                del self._evictable[b]
            self._ref_counts[b] += 1
            blocks.append(b)
        return blocks

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def check_integrity(self, owners: list[list[int]] | None = None) -> None:
        """Raise AssertionError unless the free list, the LRU, the keys and the counts agree.

        With `owners` (every live owner's block list) also check that each block's count
        equals the number of owners holding it.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & set(self._evictable), "a block is both free and evictable"
        for b, rc in enumerate(self._ref_counts):
            assert rc >= 0, f"block {b} has negative reference count"
            unowned = b in free or b in self._evictable
            assert (rc == 0) == unowned, f"block {b}: ref count {rc} but free={b in free}"
            assert (b in self._evictable) == (rc == 0 and b in self._key_of), f"block {b}: cached and unowned"
        assert all(self._block_of[k] == b for b, k in self._key_of.items()), "cache keys disagree"
        assert len(self._block_of) == len(self._key_of), "cache keys disagree"
        if owners is not None:
            counts = [0] * self.num_blocks
            for blocks in owners:
                for b in blocks:
                    counts[b] += 1
            assert counts == self._ref_counts, "reference counts differ from the owners' block lists"
