"""The reference backend against a naive dense computation written independently here."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from batchserve.attention import SeqLayout, StepLayout, TorchReferenceBackend, slots_of
from batchserve.attention.torch_ref import MAX_RUN_ROWS, slot_runs
from tests.attention.layouts import PLACEMENTS, BlockPicker
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


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_naive_dense(block_size, num_heads, num_kv_heads, seed, placement):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    head_dim, num_blocks, layer = 16, 2 * 6000 // block_size + 8, 1
    backend = TorchReferenceBackend(2, num_blocks, block_size, num_kv_heads, head_dim)
    picker = BlockPicker(rng, num_blocks, placement)

    seqs, expected_allowed, prefixes = [], [], []
    q_start = 0
    # Heterogeneous requests: long prompt chunks (run alone), decode roots with trees, mixes.
    # Jacobi windows (levels x width rows after the tree) too: a mask that is not a tree.
    kinds = ["chunk", "tree", "tree", "chunk+tree", "root", "tree", "long-tree", "small-tree", "window", "tree+window"]
    for kind in kinds:
        num_cached = 300 if kind == "small-tree" else rng.choice([0, 1, 7, 33, 200, 517])
        num_chunk = {"chunk": rng.randint(65, 130), "chunk+tree": rng.randint(2, 9)}.get(kind, 1)
        n_draft = {"tree": rng.randint(1, 20), "chunk+tree": rng.randint(1, 10), "long-tree": 64, "small-tree": 3}
        n_draft = n_draft.get(kind, rng.randint(1, 8) if kind == "tree+window" else 0)
        levels, width = (rng.randint(1, 4), rng.randint(1, 6)) if "window" in kind else (0, 0)
        tree = random_tree(rng, n_draft, 100) if n_draft else None
        parents = tree.parents if tree is not None else ()
        n_spec = n_draft + levels * width
        kv_len = num_cached + num_chunk + n_spec
        n_blocks = -(-kv_len // block_size)
        blocks = picker.take(n_blocks)
        seqs.append(SeqLayout(q_start, num_chunk + n_spec, num_cached, num_chunk, parents, blocks, (levels, width)))
        q_start += num_chunk + n_spec
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
        # Window row (level i, column j): level 0 up to column j, then column j of levels 1..i.
        base = num_cached + num_chunk + n_draft
        for i in range(levels):
            for j in range(width):
                chain = {base + c for c in range(j + 1)} | {base + lv * width + j for lv in range(1, i + 1)}
                allowed.append(set(range(num_cached + num_chunk)) | chain)
        expected_allowed.append(allowed)
        # The committed prefix already sits in the pool.
        pk = torch.randn(num_cached, num_kv_heads, head_dim)
        pv = torch.randn(num_cached, num_kv_heads, head_dim)
        pslots = slots_of(blocks, block_size, torch.arange(num_cached))
        backend.k_cache[layer, :, pslots] = pk.transpose(0, 1)
        backend.v_cache[layer, :, pslots] = pv.transpose(0, 1)
        prefixes.append((pk, pv))

    total = q_start
    q = torch.randn(1, num_heads, total, head_dim)
    k = torch.randn(1, num_kv_heads, total, head_dim)
    v = torch.randn(1, num_kv_heads, total, head_dim)
    slot_mapping = torch.cat([slots_of(s.block_ids, block_size, torch.arange(s.num_cached, s.kv_len)) for s in seqs])
    meta = backend.build_metadata(StepLayout.from_seqs(seqs), slot_mapping)
    # Each placement takes the path it exists for: views, per-run scores, or a gather.
    paths = [_path(s) for s in meta.seqs]
    assert {"contiguous": {"view"}, "runs": {"view", "runs", "gather"}, "scattered": {"view", "runs", "gather"}}[
        placement
    ] >= set(paths)
    assert placement != "runs" or "runs" in paths  # the small tree over a long prefix
    assert placement != "scattered" or "gather" in paths
    out = backend.forward(layer, q[0], k[0], v[0], meta, scale=head_dim**-0.5)[None]  # [1, T, Hq, D]
    assert out.shape == (1, total, num_heads, head_dim)

    for s, allowed, (pk, pv) in zip(seqs, expected_allowed, prefixes):
        rows = slice(s.q_start, s.q_start + s.q_len)
        k_all = torch.cat([pk, k[0, :, rows].transpose(0, 1)]).transpose(0, 1)  # [Hkv, kv_len, D]
        v_all = torch.cat([pv, v[0, :, rows].transpose(0, 1)]).transpose(0, 1)
        ref = _naive(q[0, :, rows], k_all, v_all, allowed, head_dim**-0.5)
        torch.testing.assert_close(out[0, rows].transpose(0, 1).double(), ref, rtol=1e-4, atol=1e-5)
        # This step's K/V landed in the request's own slots.
        new_slots = slots_of(s.block_ids, block_size, torch.arange(s.num_cached, s.kv_len))
        assert torch.equal(backend.k_cache[layer, :, new_slots], k[0, :, rows])  # a copy: the same bits


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


def test_mask_of_root_tree_and_window():
    # prefix 1, root, tree: 0 <- root; window of 2 levels x 2 columns after it
    s = SeqLayout(0, 6, num_cached=1, num_chunk=1, draft_parents=(None,), block_ids=(0,), window=(2, 2))
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0, 0, 0],  # the root
            [1, 1, 1, 0, 0, 0, 0],  # draft node 0
            [1, 1, 0, 1, 0, 0, 0],  # level 0, column 0
            [1, 1, 0, 1, 1, 0, 0],  # level 0, column 1: level 0 up to it
            [1, 1, 0, 1, 0, 1, 0],  # level 1, column 0: level 0 up to column 0, itself
            [1, 1, 0, 1, 1, 0, 1],  # level 1, column 1: level 0 up to column 1, itself
        ],
        dtype=torch.bool,
    )
    assert torch.equal(s.mask(), expected)


def test_copy_slots_moves_every_layer():
    backend = TorchReferenceBackend(3, 4, 2, 1, 2)
    backend.k_cache.copy_(torch.arange(3 * 8 * 2, dtype=torch.float32).view(3, 1, 8, 2))  # [L, Hkv, slots, D]
    backend.v_cache.copy_(-torch.arange(3 * 8 * 2, dtype=torch.float32).view(3, 1, 8, 2))  # unlike K
    before = {"k": backend.k_cache.clone(), "v": backend.v_cache.clone()}
    backend.copy_slots(torch.tensor([5, 7]), torch.tensor([4, 5]))  # overlapping: 5 is read then written
    for name, cache in (("k", backend.k_cache), ("v", backend.v_cache)):
        old = before[name]
        assert torch.equal(cache[:, :, 4], old[:, :, 5]) and torch.equal(cache[:, :, 5], old[:, :, 7])
        assert torch.equal(cache[:, :, :4], old[:, :, :4]) and torch.equal(cache[:, :, 6:], old[:, :, 6:])


def _path(s) -> str:
    return "gather" if s.gather is not None else "view" if len(s.runs) == 1 else "runs"


@pytest.mark.parametrize(
    ("blocks", "kv_len", "runs"),
    [
        ((4, 5, 6), 40, [(64, 40)]),  # one run, its last block partly used
        ((4, 5, 9, 2, 3), 70, [(64, 32), (144, 16), (32, 22)]),
        ((7, 1), 16, [(112, 16)]),  # blocks past the keys are ignored
        ((3,), 1, [(48, 1)]),
    ],
)
def test_slot_runs_follow_adjacent_blocks(blocks, kv_len, runs):
    assert slot_runs(np.array(blocks), kv_len, 16) == runs


def test_a_long_prompt_chunk_over_runs_is_gathered_and_a_decode_row_is_not():
    backend = TorchReferenceBackend(1, 64, 4, 1, 8)
    blocks = (0, 1, 2, 10, 11, 12, 13, 20, 21, 22, 23, 24)  # three runs
    decode = SeqLayout(0, 1, 40, 1, (), blocks[:11])
    chunk = SeqLayout(1, MAX_RUN_ROWS + 1, 20, MAX_RUN_ROWS + 1, (), blocks)
    meta = backend.build_metadata(
        StepLayout.from_seqs([decode, chunk]), torch.zeros(MAX_RUN_ROWS + 2, dtype=torch.long)
    )
    assert [_path(s) for s in meta.seqs] == ["runs", "gather"]
    assert meta.seqs[0].mask is None and meta.seqs[1].mask is not None
