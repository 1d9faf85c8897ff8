"""Start-up checks that this CPU's kernels give the invariant attention the properties it relies on."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from batchserve.attention.base import SeqLayout, StepLayout, slots_of
from batchserve.attention.invariant import InvariantBackend
from batchserve.attention.invariant_plan import KEY_TILE, MAX_SPREAD, ROW_BLOCKS


def kernels_invariant(head_dim: int = 64) -> bool:
    """Whether this CPU's kernels give `attend` the properties it relies on for heads of
    `head_dim`; checked once per process on random data (the model's products are checked by
    `batchserve.model.layers`)."""
    return invariant_row_block(head_dim) is not None


def checked_backend(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *args: Any, **kwargs: Any
) -> InvariantBackend:
    """An InvariantBackend (its arguments) on the row block this CPU keeps invariant
    (`invariant_row_block`), or the largest where none passes."""
    row_block = invariant_row_block(head_dim) or ROW_BLOCKS[-1]
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    return InvariantBackend(*shape, *args, row_block=row_block, **kwargs)


@functools.cache
def invariant_row_block(head_dim: int = 64) -> int | None:
    """The smallest of ROW_BLOCKS for which a product row has the same bits at any place in any
    call and a draft path equals the same tokens decoded; None if none does."""
    for row_block in ROW_BLOCKS:
        gen = torch.Generator().manual_seed(row_block)
        if rows_anywhere(row_block, head_dim, gen) and all(
            decoded_equals_tree(prefix, torch.Generator().manual_seed(prefix), head_dim=head_dim, row_block=row_block)
            for prefix in CHECK_PREFIXES
        ):
            return row_block
    return None


CHECK_PREFIXES = (9, KEY_TILE - 3, KEY_TILE + 40, 2 * KEY_TILE + 5)


def rows_anywhere(row_block: int, head_dim: int, gen: torch.Generator) -> bool:
    """A row's `bmm` result at places across calls of multiples of `row_block` rows against the
    same row alone at the top of a `row_block`-row call, for the score products (head_dim deep,
    64 to 320 keys) and the value products (one to three tiles deep, head_dim + 1 wide)."""
    for depth, width in ((head_dim, KEY_TILE), (head_dim, 5 * KEY_TILE), (KEY_TILE, head_dim + 1), (192, head_dim + 1)):
        a, b = torch.randn(2, 64 * row_block, depth, generator=gen), torch.randn(2, depth, width, generator=gen)
        for rows in (row_block, 3 * row_block, 16 * row_block, 64 * row_block):
            full = torch.bmm(a[:, :rows], b)
            for place in {0, rows // 2 + 1, rows - 1}:
                alone = a.new_zeros(2, row_block, depth)
                alone[:, 0] = a[:, place]
                if not torch.equal(torch.bmm(alone, b)[:, 0], full[:, place]):
                    return False
    return True


def decoded_equals_tree(
    prefix: int, gen: torch.Generator, depth: int = 4, head_dim: int = 16, row_block: int = ROW_BLOCKS[-1]
) -> bool:
    """A draft path of `depth` nodes after `prefix` keys, with MAX_SPREAD - depth siblings between
    its nodes and another request beside it, against the same tokens decoded one per step."""
    d = head_dim
    backend = InvariantBackend(1, 40, 16, 2, d, num_qo_heads=6, row_block=row_block)
    torch.randn(backend.k_cache.shape, generator=gen, out=backend.k_cache)
    backend.v_cache[..., :d] = torch.randn(backend.v_cache[..., :d].shape, generator=gen)
    siblings = np.bincount(torch.randint(0, depth, (MAX_SPREAD - depth,), generator=gen).numpy(), minlength=depth)
    parents: list[int | None] = []
    path: list[int] = []
    for level in range(depth):  # each level: its siblings, then the path's node (all children of the last one)
        parent = path[-1] if path else None
        parents += [parent] * int(siblings[level] + 1)
        path.append(len(parents) - 1)
    n = 1 + len(parents)
    blocks = tuple(range(-(-(prefix + n) // 16)))
    other = SeqLayout(n, 3, 5, 1, (None, 0), (len(blocks),))
    q, k, v = torch.randn(3, 6, n + 3, d, generator=gen)  # [heads, T, D] each
    k, v = k[:2].contiguous(), v[:2].contiguous()
    tree = _step(backend, [SeqLayout(0, n, prefix, 1, tuple(parents), blocks), other], q, k, v)
    for level, row in enumerate([0] + [node + 1 for node in path]):  # the root, then the path's nodes
        one = [SeqLayout(0, 1, prefix + level, 1, (), blocks)]
        alone = _step(backend, one, q[:, [row]], k[:, [row]].contiguous(), v[:, [row]].contiguous())
        if not torch.equal(alone[0], tree[row]):
            return False
    return True


def _step(
    backend: InvariantBackend, seqs: list[SeqLayout], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    slots = torch.cat([slots_of(s.block_ids, backend.block_size, torch.arange(s.num_cached, s.kv_len)) for s in seqs])
    meta = backend.build_metadata(StepLayout.from_seqs(seqs), slots)
    return backend.forward(0, q, k, v, meta, scale=q.shape[-1] ** -0.5)  # [T, Hq, D]
