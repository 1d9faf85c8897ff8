"""KV block bookkeeping (no tensors): which pages of the pool belong to whom, and which hold a cached prefix."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


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
        self._is_free = np.ones(num_blocks, dtype=bool)  # count 0 and not cached
        self._num_free = num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # count 0, cached; oldest first
        self._key_of: dict[int, bytes] = {}  # cached block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> cached block

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and evictable cached ones."""
        return self._num_free + len(self._evictable)

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

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """`n` blocks, placed so that an owner's blocks form few contiguous runs (the CPU
        attention reads a run in place): first the free blocks right after `after` (the owner's
        last block), then new runs in the middle of the largest free gaps, leaving room on both
        sides to grow; only when no block is free, cached blocks, the one right after the
        owner's last first (its neighbours were usually cached by the same request, at the same
        time), else the least recently used."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        blocks: list[int] = []
        b = -1 if after is None else after + 1
        while len(blocks) < n and 0 <= b < self.num_blocks and self._is_free[b]:
            blocks.append(b)
            b += 1
        self._take_free(blocks)
        if len(blocks) < n and self._num_free:
            self._take_free(runs := self._free_runs(n - len(blocks)))
            blocks += runs
        while len(blocks) < n:  # evict: a cached block gives up its prefix
            last = blocks[-1] if blocks else after
            b = last + 1 if last is not None and last + 1 in self._evictable else next(iter(self._evictable))
            del self._evictable[b]
            del self._block_of[self._key_of.pop(b)]
            blocks.append(b)
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def grow(self, block_ids: list[int], num_slots: int) -> bool:
        """Extend a request's block table in place to cover `num_slots` slots; False (and nothing
        taken) when the pool cannot."""
        need = self.blocks_for(num_slots) - len(block_ids)
        if need <= 0:
            return True
        if not self.can_allocate(need):
            return False
        block_ids.extend(self.allocate(need, after=block_ids[-1] if block_ids else None))
        return True

    def shrink(self, block_ids: list[int], num_slots: int) -> None:
        """Release the blocks of a request's table past the first `num_slots` slots."""
        keep = self.blocks_for(num_slots)
        if len(block_ids) > keep:
            self.free(block_ids[keep:])
            del block_ids[keep:]

    def _take_free(self, blocks: list[int]) -> None:
        self._is_free[blocks] = False
        self._num_free -= len(blocks)

    def _free_runs(self, n: int) -> list[int]:
        """Up to `n` free blocks: the largest gaps first, a partly used gap from its middle."""
        edges = np.flatnonzero(np.diff(self._is_free, prepend=False, append=False))  # gap i: [edges[2i], edges[2i+1])
        starts, sizes = edges[::2], edges[1::2] - edges[::2]
        blocks: list[int] = []
        for gap in np.argsort(-sizes, kind="stable").tolist():
            size = int(sizes[gap])
            take = min(size, n - len(blocks))
            first = int(starts[gap]) + (size - take) // 2
            blocks.extend(range(first, first + take))
            if len(blocks) == n:
                break
        return blocks

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
                    self._is_free[b] = True
                    self._num_free += 1

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
        free = set(np.flatnonzero(self._is_free).tolist())
        assert len(free) == self._num_free, "the free count disagrees with the free blocks"
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
