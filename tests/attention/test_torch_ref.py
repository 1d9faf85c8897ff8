"""The reference backend against a naive dense computation written independently here."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from batchserve.attention import SeqLayout, StepLayout, TorchReferenceBackend, slots_of
from batchserve.attention.torch_ref import BATCH_COST, GATHER_COST
from batchserve.attention.torch_ref import partition as partition_indices
from tests.engine.drafters import random_tree


def _naive(q, k_all, v_all, allowed, scale):
    """q [Hq, q_len, D], k/v [Hkv, kv_len, D], allowed: list of sets of visible kv indices."""
    hq, hkv = q.shape[0], k_all.shape[0]
    k = k_all.repeat_interleave(hq // hkv, dim=0).double()
    v = v_all.repeat_interleave(hq // hkv, dim=0).double()
    scores = torch.einsum("hqd,hkd->hqk", q.double(), k) * scale
    mask = torch.full(scores.shape[1:], float("-inf"), dtype=torch.float64)
    for row, cols in enumerate(allowed):
        mask[row, sorted(cols)] = 0.0
    return torch.einsum("hqk,hkd->hqd", torch.softmax(scores + mask, dim=-1), v)  # [Hq, q_len, D]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_naive_dense(block_size, num_heads, num_kv_heads, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    head_dim, num_blocks, layer = 16, 6000 // block_size + 8, 1
    backend = TorchReferenceBackend(2, num_blocks, block_size, num_kv_heads, head_dim)
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)  # scattered, non-contiguous block tables

    seqs, expected_allowed, prefixes = [], [], []
    q_start = 0
    # Heterogeneous requests: long prompt chunks (run alone), decode roots with trees, mixes.
    for kind in ["chunk", "tree", "tree", "chunk+tree", "root", "tree", "long-tree"]:
        num_cached = rng.choice([0, 1, 7, 33, 200, 517])
        num_chunk = {"chunk": rng.randint(65, 130), "chunk+tree": rng.randint(2, 9)}.get(kind, 1)
        n_draft = {"tree": rng.randint(1, 20), "chunk+tree": rng.randint(1, 10), "long-tree": 64}.get(kind, 0)
        tree = random_tree(rng, n_draft, 100) if n_draft else None
        parents = tree.parents if tree is not None else ()
        kv_len = num_cached + num_chunk + n_draft
        n_blocks = -(-kv_len // block_size)
        blocks = tuple(free_blocks.pop() for _ in range(n_blocks))
        seqs.append(SeqLayout(q_start, num_chunk + n_draft, num_cached, num_chunk, parents, blocks))
        q_start += num_chunk + n_draft
        # What each row may see, derived from first principles.
        allowed = []
        for r in range(num_chunk):
            allowed.append(set(range(num_cached + r + 1)))
        for i in range(n_draft):
            anc, node = set(), i
            while node is not None:
                anc.add(num_cached + num_chunk + node)
                node = parents[node]
            allowed.append(set(range(num_cached + num_chunk)) | anc)
        expected_allowed.append(allowed)
        # The committed prefix already sits in the pool.
        pk = torch.randn(num_cached, num_kv_heads, head_dim)
        pv = torch.randn(num_cached, num_kv_heads, head_dim)
        pslots = slots_of(blocks, block_size, torch.arange(num_cached))
        backend.k_cache[layer, pslots] = pk
        backend.v_cache[layer, pslots] = pv
        prefixes.append((pk, pv))

    total = q_start
    q = torch.randn(1, num_heads, total, head_dim)
    k = torch.randn(1, num_kv_heads, total, head_dim)
    v = torch.randn(1, num_kv_heads, total, head_dim)
    slot_mapping = torch.cat([slots_of(s.block_ids, block_size, torch.arange(s.num_cached, s.kv_len)) for s in seqs])
    meta = backend.build_metadata(StepLayout.from_seqs(seqs), slot_mapping)
    out = backend.forward(layer, q, k, v, meta, scale=head_dim**-0.5)  # [1, T, Hq, D]
    assert out.shape == (1, total, num_heads, head_dim)

    for s, allowed, (pk, pv) in zip(seqs, expected_allowed, prefixes):
        rows = slice(s.q_start, s.q_start + s.q_len)
        k_all = torch.cat([pk, k[0, :, rows].transpose(0, 1)]).transpose(0, 1)  # [Hkv, kv_len, D]
        v_all = torch.cat([pv, v[0, :, rows].transpose(0, 1)]).transpose(0, 1)
        ref = _naive(q[0, :, rows], k_all, v_all, allowed, head_dim**-0.5)
        torch.testing.assert_close(out[0, rows].transpose(0, 1).double(), ref, rtol=1e-4, atol=1e-5)
        # This step's K/V landed in the request's own slots.
        new_slots = slots_of(s.block_ids, block_size, torch.arange(s.num_cached, s.kv_len))
        torch.testing.assert_close(backend.k_cache[layer, new_slots], k[0, :, rows].transpose(0, 1))


def test_mask_of_chunk_plus_tree():
    # prefix 2, chunk 2, tree: 0 <- root, 1 <- 0, 2 <- root
    s = SeqLayout(q_start=0, q_len=5, num_cached=2, num_chunk=2, draft_parents=(None, 0, None), block_ids=(0,))
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(s.mask(), expected)


def test_copy_slots_moves_every_layer():
    backend = TorchReferenceBackend(3, 4, 2, 1, 2)
    backend.k_cache.copy_(torch.arange(3 * 8 * 2, dtype=torch.float32).view(3, 8, 1, 2))
    backend.v_cache.copy_(-torch.arange(3 * 8 * 2, dtype=torch.float32).view(3, 8, 1, 2))  # unlike K
    before = {"k": backend.k_cache.clone(), "v": backend.v_cache.clone()}
    backend.copy_slots(torch.tensor([5, 7]), torch.tensor([4, 5]))  # overlapping: 5 is read then written
    for name, cache in (("k", backend.k_cache), ("v", backend.v_cache)):
        torch.testing.assert_close(cache[:, 4], before[name][:, 5])
        torch.testing.assert_close(cache[:, 5], before[name][:, 7])
        torch.testing.assert_close(cache[:, :4], before[name][:, :4])
        torch.testing.assert_close(cache[:, 6:], before[name][:, 6:])


def _modeled_cost(groups: list[list[SeqLayout]]) -> float:
    return sum(BATCH_COST + len(g) * max(s.kv_len for s in g) * (max(s.q_len for s in g) + GATHER_COST) for g in groups)


def partition(seqs: list[SeqLayout]) -> list[list[SeqLayout]]:
    q, kv = np.array([s.q_len for s in seqs], np.int64), np.array([s.kv_len for s in seqs], np.int64)
    return [[seqs[i] for i in group] for group in partition_indices(q, kv)]


def _layout(q_len: int, kv_len: int) -> SeqLayout:
    return SeqLayout(0, q_len, kv_len - q_len, 1, (None,) * (q_len - 1), ())


@pytest.mark.parametrize("seed", range(20))
def test_partition_is_the_cheapest_split_by_rows(seed):
    rng = random.Random(seed)
    seqs = [
        _layout(rng.choice([1, 1, 1, 2, 3, 5, 9, 17, 120]), rng.randint(130, 2000)) for _ in range(rng.randint(1, 12))
    ]
    groups = partition(seqs)
    assert sorted(id(s) for g in groups for s in g) == sorted(id(s) for s in seqs)  # each request once
    # Brute force: every way to cut the requests sorted by rows between distinct row counts.
    order = sorted(seqs, key=lambda s: s.q_len)
    bounds = [i for i in range(1, len(order)) if order[i].q_len != order[i - 1].q_len]
    best = min(
        _modeled_cost([order[a:b] for a, b in itertools.pairwise([0, *cuts, len(order)])])
        for r in range(len(bounds) + 1)
        for cuts in itertools.combinations(bounds, r)
    )
    assert _modeled_cost(groups) == pytest.approx(best)


def test_partition_keeps_decode_rows_apart_from_long_rows():
    decode = [_layout(1, 400) for _ in range(15)]
    assert partition([*decode, _layout(300, 700)]) == [decode, [_layout(300, 700)]]  # a prompt chunk
    deep = _layout(9, 400)
    assert partition([deep, *decode]) == [decode, [deep]]  # one deep draft does not pad 15 rows to 9
    assert partition(decode) == [decode]  # alike requests share one batch
