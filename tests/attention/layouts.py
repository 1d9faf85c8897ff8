"""Random packed steps over a paged pool, shared by the backend parity tests."""

from __future__ import annotations

import random

import torch

from batchserve.attention import SeqLayout, slots_of
from tests.engine.drafters import random_tree

# Heterogeneous requests: prompt chunks, decode roots, draft trees and mixes of them.
KINDS = ("chunk", "tree", "tree", "chunk+tree", "root", "tree", "long-tree")


def random_step(
    rng: random.Random, block_size: int, num_blocks: int, cached: tuple[int, ...] = (0, 1, 7, 33, 200, 517)
) -> list[SeqLayout]:
    """One step's requests, packed back to back, with scattered block tables."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs, q_start = [], 0
    for kind in KINDS:
        num_cached = rng.choice(cached)
        num_chunk = {"chunk": rng.randint(65, 130), "chunk+tree": rng.randint(2, 9)}.get(kind, 1)
        n_draft = {"tree": rng.randint(1, 20), "chunk+tree": rng.randint(1, 10), "long-tree": 64}.get(kind, 0)
        parents = random_tree(rng, n_draft, 100).parents if n_draft else ()
        kv_len = num_cached + num_chunk + n_draft
        blocks = tuple(free.pop() for _ in range(-(-kv_len // block_size)))
        seqs.append(SeqLayout(q_start, num_chunk + n_draft, num_cached, num_chunk, parents, blocks))
        q_start += num_chunk + n_draft
    return seqs


def slot_mapping(seqs: list[SeqLayout], block_size: int) -> torch.Tensor:
    """Pool slot of every new row (the step's chunk and draft tokens)."""
    return torch.cat([slots_of(s.block_ids, block_size, torch.arange(s.num_cached, s.kv_len)) for s in seqs])


def blocks_needed(cached: tuple[int, ...], block_size: int) -> int:
    """A pool large enough for `random_step` with these prefix lengths."""
    return len(KINDS) * (-(-(max(cached) + 200) // block_size)) + 8
