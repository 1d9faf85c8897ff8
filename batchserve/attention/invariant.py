"""Batch-invariant attention on CPU: a query row's output has the same bits whatever rows share its step."""

# A row at position p attends over keys 0..p. Its result must not depend on how many other rows
# share the products (its prompt chunk, its draft tree, other requests), on masked keys around it,
# or on where its keys sit in the step: a draft node's ancestors lie between their siblings, while
# decoded one by one the same tokens sit side by side. So every reduction is one whose order the
# row's own keys fix:
#
# - scores: `bmm` with rows padded to a multiple of ROW_BLOCK (a lone remainder row takes
#   another kernel); each score is one dot product over the head dimension;
# - softmax: the max (exact in any order), then exp elementwise;
# - the weighted sum of values, and the softmax's denominator (a column of ones beside the
#   values), in `bmm` products over tiles of KEY_TILE logical positions: inside a tile of at most
#   KEY_TILE + MAX_SPREAD keys the product sums key after key, so zero weights (masked keys, a
#   sibling branch's) change nothing; the tiles' partial sums are added in tile order. A tile is
#   cut by logical position, not by slot, so a draft node's ancestors fall in the tiles they
#   would fill when decoded one by one.
#
# These are properties of the kernels torch ships, measured, not promised: `kernels_invariant()`
# checks them on the running CPU once, and the backend is chosen only where they hold.

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from batchserve.attention.base import StepLayout
from batchserve.attention.torch_ref import TorchReferenceBackend, slot_runs

ROW_BLOCK = 8  # rows of a product are padded to a multiple of this
MIN_KEYS = KEY_TILE = 64  # keys a score product is called with, at least; logical positions per value product
# Keys of other branches a tile may hold between a row's own: past this a request's draft rows
# stay exact but may lose bit-equality with decoding (a product over more keys blocks them).
MAX_SPREAD = 128


@dataclass(frozen=True, slots=True)
class Tiles:
    """One request's keys cut into logical tiles, each gathered into a row of `index`."""

    index: torch.Tensor  # [nt, width] int64: key of each place of each tile; L (past the end): none
    keep: torch.Tensor | None  # [nt, width] float 0/1: places holding a key of that tile; None: every key placed


def tiles_of(positions: np.ndarray, device: torch.device | str = "cpu") -> Tiles:
    """Tiles for keys at logical `positions` [L] (prefix, then this step's rows): tile t holds the
    keys at positions [t*KEY_TILE, (t+1)*KEY_TILE), gathered from the span of slots they lie in
    (a draft tree's keys of two tiles share a span; `keep` tells them apart)."""
    length = len(positions)
    key_tile = positions // KEY_TILE
    spans = []
    for t in np.unique(key_tile).tolist():
        idx = np.flatnonzero(key_tile == t)
        spans.append((t, int(idx[0]), int(idx[-1]) + 1))
    width = -(-max(hi - lo for _, lo, hi in spans) // KEY_TILE) * KEY_TILE
    index = np.full((len(spans), width), length, np.int64)
    keep = np.zeros((len(spans), width), np.float32)
    for row, (t, lo, hi) in enumerate(spans):
        index[row, : hi - lo] = np.arange(lo, hi)
        keep[row, : hi - lo] = key_tile[lo:hi] == t
    # Past the last key the weights are zero: only keys of another tile in a span need `keep`.
    shared = any((key_tile[lo:hi] != t).any() for t, lo, hi in spans)
    return Tiles(torch.from_numpy(index).to(device), torch.from_numpy(keep).to(device) if shared else None)


@dataclass(frozen=True, slots=True)
class _Seq:
    start: int  # rows [start, stop) of the packed step
    stop: int
    run: tuple[int, int] | None  # (first slot, slots) when its K/V is one run of the pool
    gather: torch.Tensor | None  # [kv_len] its slots in KV order otherwise
    mask: torch.Tensor | None  # [q_len, kv_len] bool, True: may attend; None: every row sees every key
    tiles: Tiles


@dataclass(frozen=True, slots=True)
class InvariantMetadata:
    backend: InvariantBackend
    slot_mapping: torch.Tensor  # [T]
    seqs: tuple[_Seq, ...]
    num_tokens: int


def key_positions(step: StepLayout, i: int) -> np.ndarray:
    """[kv_len] logical position of each of request i's keys: its prefix, then this step's rows
    (a draft node sits at its root's position plus its depth)."""
    return np.concatenate((np.arange(int(step.num_cached[i])), step.row_positions(i)))


class InvariantBackend(TorchReferenceBackend):
    """The torch backend's pool and bookkeeping; attention computed batch-invariantly (above)."""

    def build_metadata(self, step: StepLayout, slot_mapping: torch.Tensor) -> InvariantMetadata:
        seqs = tuple(self._invariant_seq(step, i) for i in range(len(step.q_len)))
        return InvariantMetadata(self, slot_mapping.to(self.device), seqs, step.num_tokens)

    def _invariant_seq(self, step: StepLayout, i: int) -> _Seq:
        start, stop = int(step.qo_indptr[i]), int(step.qo_indptr[i + 1])
        kv_len = int(step.kv_len[i])
        runs = slot_runs(step.block_table[i], kv_len, self.block_size)
        mask = None
        if stop - start > 1:
            own = step.step_mask(i)  # [q_len, q_len]
            if not own.all():
                full = np.ones((stop - start, kv_len), dtype=bool)
                full[:, kv_len - (stop - start) :] = own
                mask = torch.from_numpy(full).to(self.device)
        run = gather = None
        if len(runs) == 1:
            run = runs[0]
        else:
            gather = torch.from_numpy(np.concatenate([np.arange(s, s + n) for s, n in runs])).to(self.device)
        return _Seq(start, stop, run, gather, mask, tiles_of(key_positions(step, i), self.device))

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: InvariantMetadata,
        scale: float,
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        k_cache, v_cache = self.k_cache[layer_idx], self.v_cache[layer_idx]  # [Hkv, slots, D]
        k_cache.index_copy_(1, metadata.slot_mapping, k[0])  # k[0]: [Hkv, T, D]
        v_cache.index_copy_(1, metadata.slot_mapping, v[0])
        num_heads, head_dim = q.shape[1], q.shape[3]
        out = q.new_empty(num_heads, metadata.num_tokens, head_dim)  # [Hq, T, D]
        for s in metadata.seqs:
            if s.run is not None:
                first, n = s.run
                ks, vs = k_cache[:, first : first + n], v_cache[:, first : first + n]  # [Hkv, L, D] views
            else:
                ks, vs = k_cache.index_select(1, s.gather), v_cache.index_select(1, s.gather)
            out[:, s.start : s.stop] = attend(q[0, :, s.start : s.stop], ks, vs, s.mask, s.tiles, scale)
        self.seconds += time.perf_counter() - t0
        return out.transpose(0, 1).unsqueeze(0)  # [1, T, Hq, D]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, tiles: Tiles, scale: float
) -> torch.Tensor:
    """[Hq, R, D] attention of one request's rows over its keys k, v [Hkv, L, D] (in KV order)."""
    num_heads, num_rows, d = q.shape
    num_kv, length = k.shape[0], k.shape[1]
    group = num_heads // num_kv
    rows = group * num_rows  # query head h reads KV head h // group: fold each group's heads into rows
    padded = -(-rows // ROW_BLOCK) * ROW_BLOCK
    qf = q.new_zeros(num_kv, padded, d)
    qf[:, :rows].view(num_kv, group, num_rows, d).copy_(q.view(num_kv, group, num_rows, d))
    if length < MIN_KEYS:  # a product over few keys takes another kernel: zero keys up to MIN_KEYS
        k = F.pad(k, (0, 0, 0, MIN_KEYS - length))
    scores = torch.bmm(qf, k.transpose(1, 2))[:, :rows, :length]  # [Hkv, rows, L]
    if mask is not None:
        scores = scores.view(num_kv, group, num_rows, length).masked_fill(~mask, float("-inf"))
        scores = scores.view(num_kv, rows, length)
    scores = scores * scale
    # Weights with zero rows up to `padded` and a zero column past the last key: [Hkv, P, L + 1].
    weights = q.new_zeros(num_kv, padded, length + 1)
    torch.exp(scores - scores.amax(-1, keepdim=True), out=weights[:, :rows, :length])
    # Values with a column of ones (the denominator) and a zero row past the last key: [Hkv, L + 1, D + 1].
    values = v.new_zeros(num_kv, length + 1, d + 1)
    values[:, :length, :d] = v
    values[:, :length, d] = 1.0
    nt, width = tiles.index.shape
    w = weights[:, :, tiles.index]  # [Hkv, P, nt, W]
    if tiles.keep is not None:
        w = w * tiles.keep
    w = w.permute(0, 2, 1, 3).reshape(num_kv * nt, padded, width)
    parts = torch.bmm(w, values[:, tiles.index].view(num_kv * nt, width, d + 1)).view(num_kv, nt, padded, d + 1)
    acc = parts[:, 0]
    for t in range(1, nt):  # tiles in logical order: the same sums as decoding one row at a time
        acc = acc + parts[:, t]
    return (acc[:, :rows, :d] / acc[:, :rows, d:]).view(num_kv, group, num_rows, d).reshape(num_heads, num_rows, d)


@functools.cache
def kernels_invariant() -> bool:
    """Whether this CPU's kernels give `attend` the properties it relies on; checked once per
    process on random data (the model's products are checked by `batchserve.model.layers`)."""
    return _check_attend()


def _check_attend() -> bool:
    """A row decoded alone (its keys side by side) against the same row beside three others with
    up to MAX_SPREAD keys it must not see between its keys of its last tile (a draft tree's
    siblings), for contexts inside one tile and across tile boundaries."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, d = 6, 2, 16
    for n in (9, KEY_TILE - 3, KEY_TILE + 40, 2 * KEY_TILE + 5):
        k, v = torch.randn(2, kv_heads, n, d, generator=gen)
        q = torch.randn(heads, 4, d, generator=gen)
        alone = attend(q[:, :1], k, v, None, tiles_of(np.arange(n)), 0.3)
        last = (n - 1) // KEY_TILE * KEY_TILE  # the last tile's first key
        gaps = np.bincount(torch.randint(0, n - last, (MAX_SPREAD,), generator=gen).numpy(), minlength=n - last)
        real = np.concatenate((np.arange(last), last + np.arange(n - last) + np.cumsum(gaps)))
        length = int(real[-1]) + 1
        spread_k, spread_v = torch.randn(2, kv_heads, length, d, generator=gen)
        spread_k[:, torch.from_numpy(real)], spread_v[:, torch.from_numpy(real)] = k, v
        # A sibling sits at the depth (position) of the real key before it: the same tile.
        positions = np.maximum.accumulate(np.where(np.isin(np.arange(length), real), np.arange(length), 0))
        positions = np.searchsorted(real, positions)
        mask = torch.ones(4, length, dtype=torch.bool)
        mask[0] = False
        mask[0, torch.from_numpy(real)] = True
        tree = attend(q, spread_k, spread_v, mask, tiles_of(positions), 0.3)
        if not torch.equal(tree[:, :1], alone):
            return False
    return True
