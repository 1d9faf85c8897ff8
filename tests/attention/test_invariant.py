"""The batch-invariant backend: the reference's results, and a row's bits independent of its step."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import batchserve.attention.invariant_check as check
import batchserve.attention.invariant_plan as invariant_plan
from batchserve.attention import InvariantBackend, SeqLayout, StepLayout, TorchReferenceBackend, slots_of
from batchserve.attention.invariant_check import checked_backend, kernels_invariant
from batchserve.attention.invariant_plan import GROUP_COST_ROWS, KEY_TILE, group_requests, split_by_rows, tiles_of
from tests.attention.layouts import BlockPicker
from tests.engine.drafters import random_tree
from tests.rounding import assert_rounds_like

HEADS, KV_HEADS, D, BS = 6, 2, 16, 16
needs_invariance = pytest.mark.skipif(not kernels_invariant(), reason="this CPU's kernels fail the invariance check")


def _backends(num_blocks: int, gen: torch.Generator, bs: int = BS) -> tuple[InvariantBackend, TorchReferenceBackend]:
    """Both backends over the same random pool (ours: a zero block after it, values with a column of ones)."""
    ours = checked_backend(1, num_blocks, bs, KV_HEADS, D, num_qo_heads=HEADS)
    ref = TorchReferenceBackend(1, num_blocks, bs, KV_HEADS, D)
    torch.randn(ref.k_cache.shape, generator=gen, out=ref.k_cache)
    torch.randn(ref.v_cache.shape, generator=gen, out=ref.v_cache)
    slots = num_blocks * bs
    ours.k_cache[:, :, :slots], ours.v_cache[:, :, :slots, :D] = ref.k_cache, ref.v_cache
    assert (ours.v_cache[:, :, :slots, D] == 1).all() and (ours.v_cache[:, :, slots] == 0).all()
    return ours, ref


def _run(backend, seqs: list[SeqLayout], q, k, v, scale: float = D**-0.5) -> torch.Tensor:
    bs = backend.block_size
    slots = torch.cat([slots_of(s.block_ids, bs, torch.arange(s.num_cached, s.kv_len)) for s in seqs])
    meta = backend.build_metadata(StepLayout.from_seqs(seqs), slots)
    return backend.forward(0, q[0], k[0], v[0], meta, scale=scale)  # [T, Hq, D]


def exact_attention(ref: TorchReferenceBackend, seqs: list[SeqLayout], q, k, v, scale: float = D**-0.5):
    """(The reference's attention over its pool and this step in float64, each output's scale:
    sum_i p_i |v_i| over the keys it weighs, the same attention over |v|), [T, Hq, D] each: the
    exact result and its magnitude for `assert_rounds_like` (tests/rounding.py)."""
    layers, kv_heads, _, head_dim = ref.k_cache.shape
    exact = TorchReferenceBackend(layers, ref.num_blocks, ref.block_size, kv_heads, head_dim, torch.float64)
    exact.k_cache.copy_(ref.k_cache)
    exact.v_cache.copy_(ref.v_cache)
    q, k, v = q.double(), k.double(), v.double()
    out = _run(exact, seqs, q, k, v, scale)
    exact.v_cache.abs_()
    return out, _run(exact, seqs, q, k, v.abs(), scale)


def _step(rng: random.Random, picker: BlockPicker, kinds: list[tuple[int, int, int]], bs: int = BS) -> list[SeqLayout]:
    """Requests of (cached, chunk, draft nodes), packed back to back."""
    seqs, start = [], 0
    for cached, chunk, nodes in kinds:
        parents = random_tree(rng, nodes, 50).parents if nodes else ()
        q_len = chunk + nodes
        seqs.append(SeqLayout(start, q_len, cached, chunk, parents, picker.take(-(-(cached + q_len) // bs))))
        start += q_len
    return seqs


# A power-of-two scale (D**-0.5 for D = 16, 64, 256) multiplies q exactly; another scales the scores.
@pytest.mark.parametrize(("seed", "scale"), [(0, D**-0.5), (1, D**-0.5), (2, D**-0.5), (3, 0.3)])
def test_it_computes_what_the_reference_backend_does(seed, scale):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    ours, ref = _backends(400, gen)
    # A prompt chunk, decode roots with trees (one across a tile boundary), a lone root.
    kinds = [(0, 70, 0), (KEY_TILE - 4, 1, 12), (300, 3, 12), (5, 1, 0), (130, 1, 40)]
    seqs = _step(rng, BlockPicker(rng, 400, "runs"), kinds)
    total = seqs[-1].q_start + seqs[-1].q_len
    q, k, v = torch.randn(3, 1, HEADS, total, D, generator=gen)
    k, v = k[:, :KV_HEADS], v[:, :KV_HEADS]
    want = _run(ref, seqs, q, k, v, scale)
    # Two float32 orders of the same sums: each held to the exact result, not to the other by a fixed number.
    assert_rounds_like(_run(ours, seqs, q, k, v, scale), want, *exact_attention(ref, seqs, q, k, v, scale))


def test_tiles_cut_by_logical_position_and_keep_each_tiles_own_keys():
    # 62 committed keys, then a tree whose nodes sit at depths 1, 2, 1, 2, 3 (positions 62 to 64).
    positions = np.concatenate((np.arange(62), [62, 63, 62, 63, 64]))
    index, keep = tiles_of(positions)
    assert index.shape == (2, 2 * KEY_TILE)  # tile 0 spans 66 slots: a width of two tiles
    assert index[0, :66].tolist() == list(range(66)) and (index[0, 66:] == 67).all()  # 67: none
    assert keep[0].sum() == 66 and keep[1].sum() == 1  # each span holds only its own tile's keys
    assert index[1, 0] == 66 and (index[1, 1:] == 67).all()
    # Siblings of two tiles in one span: each tile keeps only its own.
    index, keep = tiles_of(np.concatenate((np.arange(63), [63, 64, 63, 64])))
    assert index[0, 63:67].tolist() == [63, 64, 65, 67] and keep[0, 63:66].tolist() == [1.0, 0.0, 1.0]
    assert index[1, :4].tolist() == [64, 65, 66, 67] and keep[1, :3].tolist() == [1.0, 0.0, 1.0]


@needs_invariance
@pytest.mark.parametrize("seed", [0, 1])
def test_a_requests_rows_have_the_same_bits_alone_and_packed_with_others(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    ours, _ = _backends(600, gen)
    kinds = [(40, 9, 0), (130, 1, 15), (0, 100, 0), (7, 1, 3), (64, 1, 0), (200, 1, 30)]
    seqs = _step(rng, BlockPicker(rng, 600, "scattered"), kinds)
    total = seqs[-1].q_start + seqs[-1].q_len
    q, k, v = torch.randn(3, 1, HEADS, total, D, generator=gen)
    k, v = k[:, :KV_HEADS].contiguous(), v[:, :KV_HEADS].contiguous()
    packed = _run(ours, seqs, q, k, v)
    for s in seqs:
        rows = slice(s.q_start, s.q_start + s.q_len)
        alone = SeqLayout(0, s.q_len, s.num_cached, s.num_chunk, s.draft_parents, s.block_ids)
        got = _run(ours, [alone], q[:, :, rows], k[:, :, rows].contiguous(), v[:, :, rows].contiguous())
        assert torch.equal(got, packed[rows])


def _buffers(sc) -> dict[str, torch.Tensor]:
    """A group's scratch buffers by name (what its layers write), those it has."""
    out = {"q": sc.q, "keys": sc.keys, "scores": sc.scores}
    if sc.by_granule is not None:
        out |= {"values": sc.by_granule.values, "tiles": sc.by_granule.tiles, "parts": sc.by_granule.parts}
    if sc.gathered is not None:
        t = sc.gathered
        out |= {"gathered_tiles": t.tiles, "gathered_values": t.values, "gathered_parts": t.parts}
    return out


def _layered_step(seed: int, layers: int = 3):
    """A backend of `layers` random layers and a step whose groups differ (short and long
    contexts, a tree, a prompt chunk): (backend, seqs, q, k, v), q/k/v [3 or 2 heads per layer]."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    blocks = 600
    ours = checked_backend(layers, blocks, BS, KV_HEADS, D, num_qo_heads=HEADS)
    slots = blocks * BS
    torch.randn(ours.k_cache[:, :, :slots].shape, generator=gen, out=ours.k_cache[:, :, :slots])
    ours.v_cache[:, :, :slots, :D] = torch.randn(ours.v_cache[:, :, :slots, :D].shape, generator=gen)
    kinds = [(20, 1, 0), (900, 1, 0), (130, 1, 9), (0, 40, 0), (25, 1, 0)]
    seqs = _step(rng, BlockPicker(rng, blocks, "scattered"), kinds)
    total = seqs[-1].q_start + seqs[-1].q_len
    q, k, v = torch.randn(3, layers, HEADS, total, D, generator=gen)
    return ours, seqs, q, k[:, :KV_HEADS].contiguous(), v[:, :KV_HEADS].contiguous()


def _run_layers(backend, seqs, q, k, v, rows: slice, scale: float, poison: bool = False):
    """Every layer of `backend` over one metadata; `poison`: the step's scratch filled with NaN
    first (every buffer a layer reads must be one it wrote)."""
    slot_ids = torch.cat([slots_of(s.block_ids, BS, torch.arange(s.num_cached, s.kv_len)) for s in seqs])
    meta = backend.build_metadata(StepLayout.from_seqs(seqs), slot_ids)
    if poison:
        for g in meta.groups:
            for buf in _buffers(g.scratch).values():
                buf.fill_(float("nan"))
    qs, ks, vs = (x[:, :, rows].contiguous() for x in (q, k, v))
    return meta, [backend.forward(i, qs[i], ks[i], vs[i], meta, scale) for i in range(len(q))]


@needs_invariance
@pytest.mark.parametrize("scale", [D**-0.5, 0.3])
def test_a_steps_groups_share_their_scratch_and_every_layer_keeps_each_rows_bits(scale):
    # Three layers over one metadata: the groups write one shared set of buffers in turn.
    ours, seqs, q, k, v = _layered_step(5)
    total = seqs[-1].q_start + seqs[-1].q_len
    meta, packed = _run_layers(ours, seqs, q, k, v, slice(0, total), scale)
    assert len(meta.groups) >= 3
    names = {name for g in meta.groups for name in _buffers(g.scratch)}
    assert {"values", "gathered_values"} <= names  # decode groups and a tree
    for name in names:  # one storage per buffer for every group that has it
        bufs = [_buffers(g.scratch).get(name) for g in meta.groups]
        assert len({b.untyped_storage().data_ptr() for b in bufs if b is not None}) == 1
    for s in seqs:
        rows = slice(s.q_start, s.q_start + s.q_len)
        alone = [SeqLayout(0, s.q_len, s.num_cached, s.num_chunk, s.draft_parents, s.block_ids)]
        _, got = _run_layers(ours, alone, q, k, v, rows, scale)
        for layer, out in enumerate(got):
            assert torch.equal(out, packed[layer][rows])


@needs_invariance
def test_a_layer_reads_only_scratch_it_wrote_and_a_step_past_the_cap_makes_its_own():
    ours, seqs, q, k, v = _layered_step(6)
    every = slice(0, seqs[-1].q_start + seqs[-1].q_len)
    _, clean = _run_layers(ours, seqs, q, k, v, every, D**-0.5)
    _, poisoned = _run_layers(ours, seqs, q, k, v, every, D**-0.5, poison=True)
    assert all(torch.equal(a, b) for a, b in zip(clean, poisoned))
    ours.scratch_bytes = 1024  # this step needs more: no step scratch, each layer its own buffers
    meta, capped = _run_layers(ours, seqs, q, k, v, every, D**-0.5)
    assert all(g.scratch is None for g in meta.groups)
    assert all(torch.equal(a, b) for a, b in zip(clean, capped))


@needs_invariance
@pytest.mark.parametrize("bs", [24, 128])  # keys read in runs of gcd(bs, KEY_TILE): 8 and 64 slots
def test_keys_are_read_in_runs_for_any_block_size(bs):
    rng, gen = random.Random(bs), torch.Generator().manual_seed(bs)
    ours, ref = _backends(40, gen, bs)
    assert ours.granule == np.gcd(bs, KEY_TILE)
    kinds = [(70, 1, 0), (100, 1, 0), (130, 1, 9), (5, 1, 0), (0, 40, 0)]  # decode roots, a tree, a chunk
    seqs = _step(rng, BlockPicker(rng, 40, "scattered"), kinds, bs)
    total = seqs[-1].q_start + seqs[-1].q_len
    q, k, v = torch.randn(3, 1, HEADS, total, D, generator=gen)
    k, v = k[:, :KV_HEADS].contiguous(), v[:, :KV_HEADS].contiguous()
    packed = _run(ours, seqs, q, k, v)
    assert_rounds_like(packed, _run(ref, seqs, q, k, v), *exact_attention(ref, seqs, q, k, v))
    decode = seqs[:2]  # alone they are one group whose rows are the step's in order
    rows = [s.q_start for s in decode]
    together = [SeqLayout(j, 1, s.num_cached, 1, (), s.block_ids) for j, s in enumerate(decode)]
    meta = ours.build_metadata(StepLayout.from_seqs(together), torch.zeros(2, dtype=torch.long))
    assert meta.in_order and meta.groups[0].tiles is None
    assert meta.groups[0].rows_in_order  # q read as it stands, where among the others it is gathered
    got = _run(ours, together, q[:, :, rows], k[:, :, rows].contiguous(), v[:, :, rows].contiguous())
    assert torch.equal(got, packed[rows])  # as among the others


@needs_invariance
def test_an_accepted_draft_node_has_the_bits_of_the_same_token_decoded():
    """A node at depth 3 (its ancestors among siblings) against the same three tokens decoded one
    step at a time, their K/V then in the pool side by side."""
    gen = torch.Generator().manual_seed(0)
    cached, parents = 61, (None, None, 0, 1, 3, 3)  # node 4's path: 1 -> 3 -> 4
    tree_blocks = tuple(range(5))
    ours, _ = _backends(20, gen)
    q, k, v = torch.randn(3, 1, HEADS, 7, D, generator=gen)
    k, v = k[:, :KV_HEADS].contiguous(), v[:, :KV_HEADS].contiguous()
    tree = _run(ours, [SeqLayout(0, 7, cached, 1, parents, tree_blocks)], q, k, v)
    # Decoded: the root (row 0), then nodes 1, 3 written at positions 62, 63; node 4 at 64.
    path = [0, 2, 4, 5]  # rows of root, node 1, node 3, node 4 (row = node + 1)
    for depth, row in enumerate(path):
        one = SeqLayout(0, 1, cached + depth, 1, (), tree_blocks)
        got = _run(ours, [one], q[:, :, [row]], k[:, :, [row]].contiguous(), v[:, :, [row]].contiguous())
        assert torch.equal(got[0], tree[row]), f"depth {depth}"


@needs_invariance
@pytest.mark.parametrize("prefix", check.CHECK_PREFIXES)
def test_the_start_up_check_passes_on_this_cpu(prefix):
    assert check.decoded_equals_tree(prefix, torch.Generator().manual_seed(prefix))


def test_the_check_fails_a_product_whose_sum_order_follows_the_row_count(monkeypatch):
    real = torch.bmm

    def order_by_rows(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        product = real(a, b) if a.shape[1] <= 8 else real(a.flip(-1), b.flip(-2))  # the reduction reversed
        return product if out is None else out.copy_(product)

    monkeypatch.setattr(check.torch, "bmm", order_by_rows)
    assert not check.decoded_equals_tree(9, torch.Generator().manual_seed(0))


def test_requests_share_products_with_those_of_a_similar_length_and_a_prompt_chunk_goes_alone():
    q_len = np.array([1, 5, 1, 300, 16, 17, 1])
    kv_len = np.array([200, 250, 3000, 900, 20, 40, 129])
    # Keys up to 64, up to 256 (129 to 250), up to 4096; then the chunks of 300 and 17 rows.
    assert group_requests(q_len, kv_len) == [[4], [0, 1, 6], [2], [3], [5]]


def test_decode_roots_are_not_padded_to_a_draft_trees_rows():
    # Twenty roots and two 6-row trees: one group would pad all 22 requests to 6 rows.
    q_len = np.array([1] * 10 + [6] + [1] * 10 + [6])
    assert split_by_rows(list(range(22)), q_len) == [[*range(10), *range(11, 21)], [10, 21]]
    # One root beside one tree: a second set of products costs more than the padding it saves.
    assert split_by_rows([0, 1], np.array([1, 6])) == [[0, 1]]
    # The cut is where padding costs more than a group: trees of 2 and 3 rows stay together.
    q_len = np.array([1] * 30 + [2, 3] * 5 + [16] * 2)
    groups = split_by_rows(list(range(len(q_len))), q_len)
    assert groups == [list(range(30)), list(range(30, 40)), [40, 41]]
    padded = sum(len(g) * max(q_len[g]) for g in groups) + GROUP_COST_ROWS * len(groups)
    assert padded < len(q_len) * 16 + GROUP_COST_ROWS


def test_the_row_check_fails_a_product_whose_rows_depend_on_their_place(monkeypatch):
    real = torch.bmm

    def by_place(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = real(a, b)
        out[:, 1::2] = real(a[:, 1::2].flip(-1), b.flip(-2))  # odd rows: the reduction reversed
        return out

    assert check.rows_anywhere(4, 64, torch.Generator().manual_seed(0))
    monkeypatch.setattr(check.torch, "bmm", by_place)
    assert not check.rows_anywhere(4, 64, torch.Generator().manual_seed(0))


def test_rows_are_padded_to_the_smallest_row_block_that_passes(monkeypatch):
    check.invariant_row_block.cache_clear()
    try:
        monkeypatch.setattr(check, "rows_anywhere", lambda row_block, *_: row_block == 8)
        assert check.invariant_row_block(16) == 8
        monkeypatch.setattr(check, "rows_anywhere", lambda *_: False)
        assert check.invariant_row_block(32) is None and not check.kernels_invariant(32)
    finally:
        check.invariant_row_block.cache_clear()
    for row_block in invariant_plan.ROW_BLOCKS:
        backend = InvariantBackend(1, 8, BS, KV_HEADS, D, num_qo_heads=HEADS, row_block=row_block)
        step = StepLayout.from_seqs([SeqLayout(0, 1, 20, 1, (), (0, 1))])
        meta = backend.build_metadata(step, torch.zeros(1, dtype=torch.long))
        assert meta.groups[0].hidden.shape[1] == row_block  # 3 query heads per KV head: 3 rows, padded
