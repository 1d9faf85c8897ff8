"""The block allocator's prefix cache: keys, references, the LRU of evictable blocks, integrity."""

from __future__ import annotations

import itertools

import pytest

from batchserve.scheduler import BlockAllocator, NoFreeBlocksError
from batchserve.scheduler.block_allocator import block_key


def _chain(tokens: list[int], block_size: int, scope: str = "") -> list[bytes]:
    keys: list[bytes] = []
    for i in range(len(tokens) // block_size):
        keys.append(block_key(keys[-1] if keys else b"", tokens[i * block_size : (i + 1) * block_size], scope))
    return keys


def test_keys_chain_tokens_position_and_scope():
    a = _chain([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != a[1] and all(len(k) == 16 for k in a)
    assert _chain([1, 2, 3, 4, 5, 6, 7, 8], 4) == a  # deterministic (not Python's per-process hash)
    assert _chain([9, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]  # same block, other prefix: other key
    assert _chain([1, 2, 3, 4, 5, 6, 7, 8], 4, scope="t:x") != a  # other scope: nothing shared
    assert block_key(b"", [1, 256], "") != block_key(b"", [256, 1], "")


def _cached_and_released(a: BlockAllocator, n: int) -> tuple[list[bytes], list[int]]:
    """One owner's `n` full blocks (tokens 0, 1, ...), cached, then released: evictable."""
    keys = _chain(list(range(n * a.block_size)), a.block_size)
    blocks = a.allocate(n)
    for b, k in zip(blocks, keys):
        a.cache(b, k)
    a.free(blocks)  # the owner finished: its blocks stay cached, evictable
    return keys, blocks


def test_cached_blocks_are_reused_then_evicted_last_recently_used_first():
    a = BlockAllocator(4, 4)
    keys, blocks = _cached_and_released(a, 3)
    assert a.num_free_blocks == 4 and a.num_cached_blocks == 3 and a.usage == 0.0
    a.check_integrity([])
    # A new owner takes a reference to the longest cached run from the first key.
    assert a.lookup([*keys[:2], b"other"]) == blocks[:2]
    assert a.ref_count(blocks[0]) == 1 and a.num_free_blocks == 2
    assert a.lookup([b"missing", keys[0]]) == []  # a run starts at the first key or not at all
    a.check_integrity([blocks[:2]])
    # Allocation takes the never-cached block first, then the least recently used cached one.
    fresh = a.allocate(1)
    assert fresh[0] not in blocks and a.num_cached_blocks == 3
    assert a.allocate(1) == [blocks[2]] and a.num_cached_blocks == 2  # its key is gone
    assert a.lookup([keys[2]]) == []
    with pytest.raises(NoFreeBlocksError):
        a.allocate(1)
    a.free([*blocks[:2], *fresh, blocks[2]])
    a.check_integrity([])


def test_a_key_keeps_its_first_block_and_free_blocks_cannot_be_cached():
    a = BlockAllocator(4, 4)
    x, y = a.allocate(2)
    a.cache(x, b"k")
    a.cache(y, b"k")  # computed twice at once: the first stays the cached one
    assert not a.is_cached(y) and a.lookup([b"k"]) == [x]
    a.free([x, x, y])
    assert a.num_free_blocks == 4 and a.num_cached_blocks == 1
    with pytest.raises(ValueError, match="free block"):
        a.cache(y, b"j")
    a.check_integrity([])
    with pytest.raises(AssertionError):
        a.check_integrity([[x]])  # an owner claims a cached block nobody holds


def _runs(blocks: list[int]) -> int:
    """Contiguous runs in a block table."""
    return 1 + sum(b != a + 1 for a, b in itertools.pairwise(blocks))


def test_growth_extends_in_place_and_new_owners_start_mid_gap():
    a = BlockAllocator(16, 4)
    first = a.allocate(2)
    assert first == [7, 8]  # the middle of the empty pool: room to grow on both sides
    assert a.allocate(2, after=first[-1]) == [9, 10]  # right after its last block
    second = a.allocate(1)
    assert second == [3]  # the middle of the largest gap left, [0, 7)
    assert a.allocate(1, after=6) == [13]  # block 7 is taken: mid of the largest gap [11, 16)
    a.check_integrity([[7, 8, 9, 10], second, [13]])


def test_eviction_prefers_the_cached_block_after_the_owner():
    a = BlockAllocator(4, 4)
    _cached_and_released(a, 4)  # LRU order: 0, 1, 2, 3
    keys = _chain(list(range(16)), 4)
    held = a.lookup(keys[:2])  # blocks 0 and 1 in use again
    assert held == [0, 1]
    assert a.allocate(1, after=held[-1]) == [2]  # the neighbour, though 2 and 3 are equally old
    assert a.allocate(1) == [3]
    a.check_integrity([[0, 1, 2, 3]])


def test_interleaved_growth_keeps_requests_in_few_runs():
    # 12 owners grow a block at a time, in turn, with owners finishing and new ones arriving:
    # the pool stays mostly in use, and each table stays in a few contiguous runs.
    a = BlockAllocator(512, 16)
    tables: list[list[int]] = []
    worst = 0
    for step in range(600):
        if len(tables) < 12:
            tables.append(a.allocate(4))
        t = tables[step % len(tables)]
        if a.num_free_blocks:
            t += a.allocate(1, after=t[-1])
        if len(t) >= 40:  # finished
            worst = max(worst, _runs(t))
            a.free(t)
            tables.remove(t)
        a.check_integrity(tables)
    assert worst <= 4, worst
