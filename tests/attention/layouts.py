"""Random packed steps over a paged pool, shared by the backend parity tests."""

from __future__ import annotations

import random

import torch

from batchserve.attention import SeqLayout, slots_of
from tests.engine.drafters import random_tree

# Heterogeneous requests: prompt chunks, decode roots, draft trees, Jacobi windows and mixes of them.
KINDS = ("chunk", "tree", "tree", "chunk+tree", "root", "tree", "long-tree", "tree+window")


# How a request's blocks lie in the pool: one contiguous run, a few runs, or scattered.
PLACEMENTS = ("contiguous", "runs", "scattered")


class BlockPicker:
    """Hands out distinct blocks of a pool in one of the `PLACEMENTS`."""

    def __init__(self, rng: random.Random, num_blocks: int, placement: str = "scattered") -> None:
        self.rng, self.placement = rng, placement
        self.free = list(range(num_blocks))
        if placement == "scattered":
            rng.shuffle(self.free)
        else:
            self.free.reverse()  # pop() walks up the pool

    def take(self, n: int) -> tuple[int, ...]:
        if self.placement == "runs" and n > 1:  # 2 to 4 runs: skip a block or two between them
            cuts = sorted(self.rng.sample(range(1, n), min(n - 1, self.rng.randint(1, 3))))
            blocks: list[int] = []
            for run, (a, b) in enumerate(zip([0, *cuts], [*cuts, n])):
                if run:
                    del self.free[-self.rng.randint(1, 2) :]
                blocks.extend(self.free.pop() for _ in range(b - a))
            return tuple(blocks)
        return tuple(self.free.pop() for _ in range(n))


def random_step(
    rng: random.Random,
    block_size: int,
    num_blocks: int,
    cached: tuple[int, ...] = (0, 1, 7, 33, 200, 517),
    placement: str = "scattered",
) -> list[SeqLayout]:
    """One step's requests, packed back to back, their blocks placed as `placement` says."""
    picker = BlockPicker(rng, num_blocks, placement)
    seqs, q_start = [], 0
    for kind in KINDS:
        num_cached = rng.choice(cached)
        num_chunk = {"chunk": rng.randint(65, 130), "chunk+tree": rng.randint(2, 9)}.get(kind, 1)
        n_draft = {"tree": rng.randint(1, 20), "chunk+tree": rng.randint(1, 10), "long-tree": 64}.get(kind, 0)
        n_draft = rng.randint(1, 8) if kind == "tree+window" else n_draft
        window = (rng.randint(1, 4), rng.randint(1, 6)) if kind == "tree+window" else (0, 0)
        parents = random_tree(rng, n_draft, 100).parents if n_draft else ()
        n_spec = n_draft + window[0] * window[1]
        kv_len = num_cached + num_chunk + n_spec
        blocks = picker.take(-(-kv_len // block_size))
        seqs.append(SeqLayout(q_start, num_chunk + n_spec, num_cached, num_chunk, parents, blocks, window))
        q_start += num_chunk + n_spec
    return seqs


def slot_mapping(seqs: list[SeqLayout], block_size: int) -> torch.Tensor:
    """Pool slot of every new row (the step's chunk and draft tokens)."""
    return torch.cat([slots_of(s.block_ids, block_size, torch.arange(s.num_cached, s.kv_len)) for s in seqs])


def blocks_needed(cached: tuple[int, ...], block_size: int) -> int:
    """A pool large enough for `random_step` with these prefix lengths."""
    return 2 * len(KINDS) * (-(-(max(cached) + 200) // block_size)) + 8  # room for the gaps of "runs"
