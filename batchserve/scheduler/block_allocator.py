"""KV block bookkeeping (no tensors): which pages of the pool belong to whom."""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockAllocator:
    """Reference-counted allocator over `num_blocks` KV pages.

    A block is free exactly when its reference count is 0; `free` decrements and returns the
    block to the free list at 0, so a block shared by several owners (e.g. a forked prefix)
    stays allocated until the last owner lets go.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` slots."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def fork(self, blocks: list[int]) -> list[int]:
        """Share `blocks` with another owner (one more reference each)."""
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise ValueError(f"cannot share free block {b}")
            self._ref_counts[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref_counts[b] < 1:
                raise ValueError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def check_integrity(self, owners: list[list[int]] | None = None) -> None:
        """Raise AssertionError unless the free list and reference counts agree.

        With `owners` (every live owner's block list) also check that each block's count
        equals the number of owners holding it.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, rc in enumerate(self._ref_counts):
            assert rc >= 0, f"block {b} has negative reference count"
            assert (rc == 0) == (b in free), f"block {b}: ref count {rc} but free={b in free}"
        if owners is not None:
            counts = [0] * self.num_blocks
            for blocks in owners:
                for b in blocks:
                    counts[b] += 1
            assert counts == self._ref_counts, "reference counts differ from the owners' block lists"
