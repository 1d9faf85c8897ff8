"""Sliding windows, logit soft-caps and attention sinks (`LayerAttention`) in every CPU backend:
each row attends over the keys of its own window by position (a draft node's as much as a decoded
token's), its scores capped before the mask, each head's sink in its softmax; and the invariant
backends keep a row's bits alone, packed, at any thread count, and for a draft node, those of its
token decoded. A backend without sinks refuses a layer that has them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from batchserve import kernels
from batchserve.attention import (
    KernelBackend,
    LayerAttention,
    SeqLayout,
    StepLayout,
    TorchReferenceBackend,
    kernels_invariant,
    slots_of,
)
from batchserve.attention.base import AttentionBackend
from batchserve.attention.invariant_check import checked_backend
from tests.attention.layouts import BlockPicker
from tests.attention.test_invariant import _step

HEADS, KV_HEADS, D, BS = 6, 2, 64, 16
KINDS = {
    "window": LayerAttention(window=20),
    "softcap": LayerAttention(softcap=1.5),
    "both": LayerAttention(window=7, softcap=2.0),
    "sinks": LayerAttention(window=9, sinks=(0.5, -1.0, 2.0, 0.0, 1.5, -0.25)),  # gpt-oss's: one per query head
}


def _make(name: str, num_blocks: int) -> AttentionBackend:
    if name == "kernel":
        if not kernels.available():
            pytest.skip(f"{kernels.unavailable_reason()}")
        return KernelBackend(1, num_blocks, BS, KV_HEADS, D)
    if name == "invariant":
        if not kernels_invariant(D):
            pytest.skip("torch's kernels are not batch-invariant on this CPU")
        return checked_backend(1, num_blocks, BS, KV_HEADS, D, num_qo_heads=HEADS)
    return TorchReferenceBackend(1, num_blocks, BS, KV_HEADS, D)


def _backend(name: str, kind: LayerAttention, num_blocks: int, gen: torch.Generator) -> AttentionBackend:
    backend = _make(name, num_blocks)
    backend.set_layers((kind,))
    pool = torch.randn(2, *backend.k_cache.shape[:3], D, generator=gen)
    backend.k_cache[..., :D].copy_(pool[0])
    backend.v_cache[..., :D].copy_(pool[1])  # the invariant pool keeps a column of ones past D
    return backend


def _run(backend: AttentionBackend, seqs: list[SeqLayout], q, k, v, scale: float = D**-0.5) -> torch.Tensor:
    slots = torch.cat([slots_of(s.block_ids, BS, torch.arange(s.num_cached, s.kv_len)) for s in seqs])
    meta = backend.build_metadata(StepLayout.from_seqs(seqs), slots)
    return backend.forward(0, q, k, v, meta, scale=scale)  # [T, Hq, D]


def _exact(backend: AttentionBackend, seqs, q, k, v, kind: LayerAttention, scale: float = D**-0.5) -> torch.Tensor:
    """Each row by the definition, in float64: its keys (the pool's as the step left them), the mask
    of its tree and its window by position, the scores scaled and capped."""
    keys, values = backend.k_cache[0, :, :, :D].double(), backend.v_cache[0, :, :, :D].double()
    out = torch.zeros(q.shape[1], HEADS, D, dtype=torch.float64)
    step = StepLayout.from_seqs(seqs)
    for i, s in enumerate(seqs):
        slots = slots_of(s.block_ids, BS, torch.arange(s.kv_len))
        kh = keys[:, slots].repeat_interleave(HEADS // KV_HEADS, 0)  # [Hq, kv, D]
        vh = values[:, slots].repeat_interleave(HEADS // KV_HEADS, 0)
        rows = q[:, s.q_start : s.q_start + s.q_len].double()  # [Hq, q_len, D]
        scores = rows @ kh.transpose(1, 2) * scale
        if kind.softcap is not None:
            scores = kind.softcap * torch.tanh(scores / kind.softcap)
        mask = s.mask()
        if kind.window is not None:
            positions = step.row_positions(i)
            keys_at = np.concatenate((np.arange(s.num_cached), positions))
            mask &= torch.from_numpy(positions[:, None] - keys_at[None, :] < kind.window)
        scores = scores.masked_fill(~mask, float("-inf"))
        if kind.sinks is not None:  # a column with no value in each head's softmax
            sink = torch.tensor(kind.sinks, dtype=scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
            weights = torch.softmax(torch.cat((scores, sink), -1), -1)[..., :-1]
        else:
            weights = torch.softmax(scores, -1)
        out[s.q_start : s.q_start + s.q_len] = (weights @ vh).transpose(0, 1)
    return out


# A prompt chunk past the window, decode roots with trees (deep ones cross the window), a lone root,
# a short context the window never reaches.
STEP = [(0, 40, 0), (60, 1, 12), (300, 3, 12), (5, 1, 0), (130, 1, 30), (3, 2, 2)]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("name", ["torch", "kernel", "invariant"])
def test_each_row_attends_over_its_window_with_capped_scores(name, kind):
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    backend = _backend(name, KINDS[kind], 120, gen)
    seqs = _step(rng, BlockPicker(rng, 120, "scattered"), STEP)
    q, k, v = torch.randn(3, HEADS, seqs[-1].q_start + seqs[-1].q_len, D, generator=gen)
    got = _run(backend, seqs, q, k[:KV_HEADS], v[:KV_HEADS])
    exact = _exact(backend, seqs, q, k[:KV_HEADS], v[:KV_HEADS], KINDS[kind])
    assert (got.double() - exact).abs().max() < 1e-5
    # ... which the plain attention (every key, no cap) is far from: the kind was applied.
    plain = _exact(backend, seqs, q, k[:KV_HEADS], v[:KV_HEADS], LayerAttention())
    assert (plain - exact).abs().max() > 1e-2


@pytest.mark.parametrize(("name", "kind_name"), [(n, k) for n in ("kernel", "invariant") for k in ("both", "sinks")])
def test_a_rows_bits_are_the_same_alone_packed_and_at_any_thread_count(name, kind_name):
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    kind = KINDS[kind_name]
    backend = _backend(name, kind, 120, gen)
    seqs = _step(rng, BlockPicker(rng, 120, "scattered"), STEP)
    q, k, v = torch.randn(3, HEADS, seqs[-1].q_start + seqs[-1].q_len, D, generator=gen)
    k, v = k[:KV_HEADS], v[:KV_HEADS]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {}
        for s in seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            one = SeqLayout(0, s.q_len, s.num_cached, s.num_chunk, s.draft_parents, s.block_ids)
            alone[s.q_start] = _run(backend, [one], q[:, rows], k[:, rows], v[:, rows])
        for threads in (2, 3):
            torch.set_num_threads(threads)
            packed = _run(backend, seqs, q, k, v)
            for s in seqs:
                assert torch.equal(packed[s.q_start : s.q_start + s.q_len], alone[s.q_start]), (threads, s.q_start)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["kernel", "invariant"])
def test_a_draft_node_past_the_window_has_the_bits_of_its_token_decoded(name):
    """A depth-3 node under a 3-key window sees its two ancestors and itself, not the root: decoded
    one token at a time, the same token sees the same keys."""
    gen = torch.Generator().manual_seed(2)
    kind = LayerAttention(window=3, softcap=3.0)
    backend = _backend(name, kind, 20, gen)
    cached, parents = 61, (None, None, 0, 1, 3, 3)  # node 4's path: 1 -> 3 -> 4
    blocks = tuple(range(5))
    q, k, v = torch.randn(3, HEADS, 7, D, generator=gen)
    k, v = k[:KV_HEADS], v[:KV_HEADS]
    tree = _run(backend, [SeqLayout(0, 7, cached, 1, parents, blocks)], q, k, v)
    for depth, row in enumerate([0, 2, 4, 5]):  # rows of root, node 1, node 3, node 4 (row = node + 1)
        one = SeqLayout(0, 1, cached + depth, 1, (), blocks)
        got = _run(backend, [one], q[:, [row]], k[:, [row]], v[:, [row]])
        assert torch.equal(got[0], tree[row]), f"depth {depth}"


def test_kinds_are_checked_and_the_backends_know_each_layers():
    with pytest.raises(ValueError, match="at least one key"):
        LayerAttention(window=0)
    with pytest.raises(ValueError, match="positive"):
        LayerAttention(softcap=-1.0)
    backend = TorchReferenceBackend(3, 4, BS, KV_HEADS, D)
    assert backend.layer(2) == LayerAttention() and backend.windows == ()
    backend.set_layers((LayerAttention(8), LayerAttention(), LayerAttention(8, 50.0)))
    assert backend.windows == (8,) and backend.layer(2).softcap == 50.0
