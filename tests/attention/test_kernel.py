"""The kernel backend (our C++ attention): the reference's results, and a row's bits independent
of its step, its keys' place in the pool and the thread count."""

from __future__ import annotations

import random

import pytest
import torch

from batchserve import kernels
from batchserve.attention import SeqLayout, StepLayout, TorchReferenceBackend
from batchserve.attention.kernel import KernelBackend, plan_rows
from tests.attention.layouts import BlockPicker
from tests.attention.test_invariant import _run, _step, exact_attention
from tests.rounding import assert_rounds_like, rounding_units

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")
HEADS, KV_HEADS, D = 6, 2, 64


def _backends(num_blocks: int, gen: torch.Generator, bs: int = 16) -> tuple[KernelBackend, TorchReferenceBackend]:
    ours = KernelBackend(1, num_blocks, bs, KV_HEADS, D)
    ref = TorchReferenceBackend(1, num_blocks, bs, KV_HEADS, D)
    torch.randn(ref.k_cache.shape, generator=gen, out=ref.k_cache)
    torch.randn(ref.v_cache.shape, generator=gen, out=ref.v_cache)
    ours.k_cache.copy_(ref.k_cache)
    ours.v_cache.copy_(ref.v_cache)
    return ours, ref


def _inputs(total: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = torch.randn(3, 1, HEADS, total, D, generator=gen)
    return q, k[:, :KV_HEADS], v[:, :KV_HEADS]  # k and v: views with a head stride of HEADS rows


@pytest.mark.parametrize(("seed", "scale", "bs"), [(0, D**-0.5, 16), (1, D**-0.5, 5), (2, 0.3, 16)])
def test_it_computes_what_the_reference_backend_does(seed, scale, bs):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    ours, ref = _backends(500, gen, bs)
    # A prompt chunk, a chunk after a prefix, decode roots with trees, a lone root, a long context.
    kinds = [(0, 70, 0), (40, 9, 0), (60, 1, 12), (300, 3, 12), (5, 1, 0), (130, 1, 40), (1000, 1, 0)]
    seqs = _step(rng, BlockPicker(rng, 500, "scattered"), kinds, bs)
    q, k, v = _inputs(seqs[-1].q_start + seqs[-1].q_len, gen)
    got, want = _run(ours, seqs, q, k, v, scale), _run(ref, seqs, q, k, v, scale)
    assert torch.equal(ours.k_cache, ref.k_cache) and torch.equal(ours.v_cache, ref.v_cache)  # the same writes
    # Our kernel and torch's ops sum in different orders (the kernel's built for this CPU's vector
    # width): each is held to the exact result by what the reference's float32 order is off here.
    exact, magnitude = exact_attention(ref, seqs, q, k, v, scale)
    bound = assert_rounds_like(got, want, exact, magnitude)
    # ... which a scale 1e-5 off exceeds several times over.
    assert rounding_units(_run(ours, seqs, q, k, v, scale * (1 + 1e-5)), exact, magnitude) > 4 * bound


@pytest.mark.parametrize("seed", [0, 1])
def test_a_requests_rows_have_the_same_bits_alone_packed_and_at_any_thread_count(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    ours, _ = _backends(600, gen)
    kinds = [(40, 9, 0), (130, 1, 15), (0, 100, 0), (7, 1, 3), (64, 1, 0), (200, 1, 30)]
    seqs = _step(rng, BlockPicker(rng, 600, "scattered"), kinds)
    q, k, v = _inputs(seqs[-1].q_start + seqs[-1].q_len, gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {}
        for s in seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            one = SeqLayout(0, s.q_len, s.num_cached, s.num_chunk, s.draft_parents, s.block_ids)
            alone[s.q_start] = _run(ours, [one], q[:, :, rows], k[:, :, rows], v[:, :, rows])
        for threads in (2, 3, 8):
            torch.set_num_threads(threads)
            packed = _run(ours, seqs, q, k, v)
            for s in seqs:
                assert torch.equal(packed[s.q_start : s.q_start + s.q_len], alone[s.q_start]), (threads, s.q_start)
    finally:
        torch.set_num_threads(before)


def test_an_accepted_draft_node_has_the_bits_of_the_same_token_decoded():
    """A node at depth 3 (its ancestors among siblings) against the same tokens decoded one step
    at a time, their K/V then in the pool side by side."""
    gen = torch.Generator().manual_seed(0)
    cached, parents = 61, (None, None, 0, 1, 3, 3)  # node 4's path: 1 -> 3 -> 4
    blocks = tuple(range(5))
    ours, _ = _backends(20, gen)
    q, k, v = _inputs(7, gen)
    tree = _run(ours, [SeqLayout(0, 7, cached, 1, parents, blocks)], q, k, v)
    for depth, row in enumerate([0, 2, 4, 5]):  # rows of root, node 1, node 3, node 4 (row = node + 1)
        one = SeqLayout(0, 1, cached + depth, 1, (), blocks)
        got = _run(ours, [one], q[:, :, [row]], k[:, :, [row]], v[:, :, [row]])
        assert torch.equal(got[0], tree[row]), f"depth {depth}"


def test_each_row_lists_its_keys_in_logical_order():
    # 3 cached keys, a chunk of 2, then nodes 0 (child of the chunk), 1 (of 0), 2 (of the chunk), 3 (of 1).
    seq = SeqLayout(0, 6, 3, 2, (None, 0, None, 1), (4, 7, 2))
    slots, prefix_at, prefix_len, tails, tail_at, tail_len = plan_rows(StepLayout.from_seqs([seq]), 4)
    assert slots.tolist() == [16, 17, 18, 19, 28, 29, 30, 31, 8]  # blocks 4, 7, then 2 (9 keys)
    assert prefix_at.tolist() == [0] * 6 and prefix_len.tolist() == [4, 5, 5, 5, 5, 5]
    paths = [tails[a : a + n].tolist() for a, n in zip(tail_at, tail_len)]
    # Node i's key is logical position 5 + i: slots 29, 30, 31, 8.
    assert paths == [[], [], [29], [29, 30], [31], [29, 30, 8]]


def test_it_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="kernel attention backend"):
        KernelBackend(1, 4, 16, 2, 12)  # a head dim not divisible by 8
    with pytest.raises(ValueError, match="kernel attention backend"):
        KernelBackend(1, 4, 16, 2, 64, dtype=torch.bfloat16)
