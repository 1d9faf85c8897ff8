"""Batch-invariant attention on CPU: a query row's output has the same bits whatever rows share its step."""

# A row at position p attends over keys 0..p. Its result must not depend on how many other rows
# share the products (its prompt chunk, its draft tree, other requests), on masked keys around it,
# or on where its keys sit in the step: a draft node's ancestors lie between their siblings, while
# decoded one by one the same tokens sit side by side. So every reduction is one whose order the
# row's own keys fix:
#
# - scores: `bmm` with rows padded to a multiple of a row block (4 where this CPU's kernels give
#   a row the same bits at any place in any call of a multiple of 4 rows, else 8: a lone
#   remainder row takes another kernel) and at least MIN_KEYS keys; each score is one dot
#   product over the head dim;
# - softmax: the max (exact in any order), then exp elementwise;
# - the weighted sum of values and the softmax's denominator (the pool keeps a column of ones
#   beside every value) in `bmm` products over tiles of KEY_TILE logical positions: inside a tile
#   of at most KEY_TILE + MAX_SPREAD keys the product sums key after key, so zero weights (masked
#   keys, a sibling branch's) change nothing; the tiles' partial sums are added in tile order. A
#   tile is cut by logical position, not by slot, so a draft node's ancestors fall in the tiles
#   they would fill when decoded one by one.
#
# Requests with few rows (decode roots, draft trees) of similar key and row counts are attended
# together, padded to the group's largest, in one set of products per layer; a long prompt chunk
# is a group of its own.
# These are properties of the kernels torch ships, measured, not promised: `kernels_invariant()`
# (invariant_check.py) checks them on the running CPU once, and the backend is chosen only where
# they hold.

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from batchserve.attention.base import StepLayout
from batchserve.attention.invariant_plan import KEY_TILE, MIN_KEYS, ROW_BLOCKS, group_requests, product_rows, tiles_of
from batchserve.attention.torch_ref import TorchReferenceBackend


@dataclass(frozen=True, slots=True)
class Group:
    """Requests attended in one set of products, rows and keys padded to the group's largest."""

    rows: torch.Tensor  # [B, R] step row of each row place (padding: the request's first row)
    rows_in_order: bool  # rows are the step's rows 0..T-1 as they stand: q is read without a gather
    out_places: torch.Tensor | None  # [n] places (in the flattened [B, R]) holding real rows; None: all of them
    out_rows: torch.Tensor  # [n] their step rows
    key_granules: torch.Tensor  # [B, Lk/g] pool granule of each run of g keys (padding: the zero block's)
    hidden: torch.Tensor  # [B, P, Lk] bool over the product's rows (head-major, padded): True may not attend
    # None where every request's keys are in logical order (decode rows, chunks, chains): tile t
    # is keys [t*KEY_TILE, (t+1)*KEY_TILE), read straight from the scores and the key granules.
    tiles: Tiles | None


@dataclass(frozen=True, slots=True)
class Tiles:
    """Value tiles of a group with draft trees. The first `first` tiles hold every request's
    committed keys in logical order (a draft node's position is past its request's prefix): they
    are read as they stand, by granule, like a decode group's. The tiles from `first` on are
    gathered key by key; their indexes count from key `first * KEY_TILE`."""

    first: int
    prefix_granules: torch.Tensor  # [B * first * KEY_TILE / g] pool granules of the leading tiles' keys
    tile_slots: torch.Tensor  # [B, nt, W] pool slot of each later tile place (past a span: the zero slot)
    tile_keys: torch.Tensor  # [B, nt, W] the same as an index into the keys from `first` on (past them: none)
    keep: torch.Tensor | None  # [B, nt, W] float 0/1, where a span holds keys of two tiles


@dataclass(frozen=True, slots=True)
class InvariantMetadata:
    backend: InvariantBackend
    slot_mapping: torch.Tensor  # [T]
    groups: tuple[Group, ...]
    num_tokens: int
    in_order: bool  # one group whose real rows are the step's rows in order: its output is the step's


class InvariantBackend(TorchReferenceBackend):
    """The torch backend's paged pool plus a zero block at its end, the values stored with a
    column of ones; attention computed batch-invariantly (above). Keys (and, where tiles are
    the identity, values) are gathered in granules of g = gcd(block size, KEY_TILE) slots, a
    request's logical positions in order: far fewer, larger copies than slot by slot."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_qo_heads: int | None = None,
        row_block: int | None = None,
    ) -> None:
        super().__init__(num_layers, 0, block_size, num_kv_heads, head_dim, dtype, device)
        self.group = (num_qo_heads or num_kv_heads) // num_kv_heads  # query heads per KV head
        if row_block is None:
            from batchserve.attention.invariant_check import invariant_row_block  # it builds backends

            row_block = invariant_row_block(head_dim) or ROW_BLOCKS[-1]
        self.row_block = row_block
        self.num_blocks = num_blocks
        self.granule = math.gcd(block_size, KEY_TILE)
        self.zero_slot = slots = num_blocks * block_size  # the zero block's first slot
        size = slots + block_size
        self.k_cache = torch.zeros(num_layers, num_kv_heads, size, head_dim, dtype=dtype, device=device)
        self.v_cache = torch.zeros(num_layers, num_kv_heads, size, head_dim + 1, dtype=dtype, device=device)
        self.v_cache[:, :, :slots, head_dim] = 1.0  # the denominator's column
        # Each layer's views, made once (a step would make 90 of them): [Hkv, S, D], [Hkv, S, D+1], [Hkv, S, D].
        self._layers = [(k, v, v[..., :head_dim]) for k, v in zip(self.k_cache, self.v_cache)]

    def build_metadata(self, step: StepLayout, slot_mapping: torch.Tensor) -> InvariantMetadata:
        groups = tuple(self._group(step, m) for m in group_requests(step.q_len, step.kv_len))
        t = step.num_tokens
        in_order = len(groups) == 1 and torch.equal(groups[0].out_rows.cpu(), torch.arange(t))
        return InvariantMetadata(self, slot_mapping.to(self.device), groups, t, in_order)

    def _slots(self, step: StepLayout, i: int, logical: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return step.block_table[i, logical // bs] * bs + logical % bs

    def _group(self, step: StepLayout, members: list[int]) -> Group:
        b, g = len(members), self.granule
        q_len, kv_len = step.q_len[members], step.kv_len[members]
        r = int(q_len.max())
        lk = max(MIN_KEYS, -(-int(kv_len.max()) // KEY_TILE) * KEY_TILE)
        positions = [np.concatenate((np.arange(step.num_cached[i]), step.row_positions(i))) for i in members]
        rows = np.zeros((b, r), np.int64)
        granules = np.full((b, lk // g), self.zero_slot // g, np.int64)
        mask = np.zeros((b, r, lk), bool)
        for j, i in enumerate(members):
            start, q, kv, cached = int(step.qo_indptr[i]), int(q_len[j]), int(kv_len[j]), int(step.num_cached[i])
            rows[j] = start
            rows[j, :q] = start + np.arange(q)
            used = -(-kv // g)  # past kv the granule's slots are masked (zero weight): any finite values do
            granules[j, :used] = self._slots(step, i, np.arange(used) * g) // g
            mask[j, :q, :cached] = True
            mask[j, :q, cached:kv] = step.step_mask(i) if q > 1 else True
            mask[j, q:, 0] = True  # padding rows
        real = (np.arange(r)[None, :] < q_len[:, None]).reshape(-1)
        in_order = all(np.array_equal(p, np.arange(len(p))) for p in positions)
        dev = self.device
        return Group(
            rows=torch.from_numpy(rows).to(dev),
            rows_in_order=rows.size == step.num_tokens and bool((rows.reshape(-1) == np.arange(rows.size)).all()),
            out_places=None if real.all() else torch.from_numpy(np.flatnonzero(real)).to(dev),
            out_rows=torch.from_numpy(rows.reshape(-1)[real]).to(dev),
            key_granules=torch.from_numpy(granules).to(dev),
            hidden=torch.from_numpy(product_rows(~mask, self.group, self.row_block)).to(dev),
            tiles=None if in_order else self._tiles(step, members, positions, lk, granules),
        )

    def _tiles(
        self, step: StepLayout, members: list[int], positions: list[np.ndarray], lk: int, granules: np.ndarray
    ) -> Tiles:
        """Tiles of a group whose keys are not all in logical order (draft trees)."""
        b = len(members)
        # Tiles that hold only committed keys in every request: their keys stand in logical order.
        first = min(int(step.num_cached[i]) for i in members) // KEY_TILE
        start = first * KEY_TILE  # the later tiles' indexes count from here; lk - start: none
        tiles = [tuple(x[first:] for x in tiles_of(p)) for p in positions]
        nt, width = max(t[0].shape[0] for t in tiles), max(t[0].shape[1] for t in tiles)
        keys = np.full((b, lk + 1), self.zero_slot, np.int64)  # one more: the index of "none"
        tile_keys = np.full((b, nt, width), lk, np.int64)
        keep = np.zeros((b, nt, width), np.float32)
        shared = False  # whether some span holds keys of two tiles
        for j, i in enumerate(members):
            kv = int(step.kv_len[i])
            keys[j, :kv] = self._slots(step, i, np.arange(kv))
            index, own = tiles[j]
            tile_keys[j, : index.shape[0], : index.shape[1]] = np.where(index < kv, index, lk)
            keep[j, : own.shape[0], : own.shape[1]] = own
            shared |= bool(((index < kv) & (own == 0)).any())
        tile_slots = np.take_along_axis(keys, tile_keys.reshape(b, -1), 1).reshape(tile_keys.shape)
        dev = self.device
        return Tiles(
            first=first,
            prefix_granules=torch.from_numpy(granules[:, : start // self.granule].reshape(-1)).to(dev),
            tile_slots=torch.from_numpy(tile_slots).to(dev),
            tile_keys=torch.from_numpy(tile_keys - start).to(dev),
            keep=torch.from_numpy(keep).to(dev) if shared else None,
        )

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: InvariantMetadata,
        scale: float,
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        k_cache, v_cache, v_values = self._layers[layer_idx]  # [Hkv, S, D], [Hkv, S, D+1], [Hkv, S, D]
        d = q.shape[3]
        k_cache.index_copy_(1, metadata.slot_mapping, k[0])  # k[0]: [Hkv, T, D]
        v_values.index_copy_(1, metadata.slot_mapping, v[0])
        if metadata.in_order:  # one group, the step's rows in order (decode steps): no scatter
            out = attend(q[0], k_cache, v_cache, metadata.groups[0], scale, self.granule)
        else:
            out = q.new_empty(metadata.num_tokens, q.shape[1], d)  # [T, Hq, D]
            for g in metadata.groups:
                out[g.out_rows] = attend(q[0], k_cache, v_cache, g, scale, self.granule)
        self.seconds += time.perf_counter() - t0
        return out.unsqueeze(0)  # [1, T, Hq, D], contiguous


def _tile_products(
    weights: torch.Tensor, v_cache: torch.Tensor, granules: torch.Tensor, granule: int, nt: int
) -> list[torch.Tensor]:
    """The value products of `nt` tiles whose keys stand in logical order: weights [Hkv, B, P,
    nt*KEY_TILE] (a view), values read from the pool by granule (`granules`: [B * nt*KEY_TILE/g])."""
    if nt == 0:
        return []
    num_kv, b, padded, _ = weights.shape
    d1 = v_cache.shape[-1]  # D + 1: the values and the ones
    values = v_cache.view(num_kv, -1, granule * d1).index_select(1, granules)  # [Hkv, B*nt*W/g, g*(D+1)]
    return _products(weights.view(num_kv, b, padded, nt, KEY_TILE), values)


def _products(w: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
    """Per tile, weights w [Hkv, B, P, nt, W] times its values (`values`: [Hkv, B*nt*W, D+1] in
    any view of that size): nt partial sums [Hkv, B, P, D+1], each over its tile's keys in order."""
    num_kv, b, padded, nt, width = w.shape
    w = w.permute(0, 1, 3, 2, 4).reshape(num_kv * b * nt, padded, width)
    parts = torch.bmm(w, values.reshape(num_kv * b * nt, width, -1))  # [Hkv*B*nt, P, D+1]
    return list(parts.view(num_kv, b, nt, padded, -1).unbind(2))


def attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: Group, scale: float, granule: int
) -> torch.Tensor:
    """[n, Hq, D]: the group's real rows of q [Hq, T, D] attended over its keys in the pool
    (k_cache [Hkv, S, D], v_cache [Hkv, S, D+1], read in runs of `granule` slots)."""
    num_heads, _, d = q.shape
    num_kv = k_cache.shape[0]
    group = num_heads // num_kv  # query head h reads KV head h // group: fold each group's heads into rows
    b, r = g.rows.shape
    lk = g.hidden.shape[-1]
    rows, padded = group * r, g.hidden.shape[1]
    qf = q.new_zeros(num_kv, b, padded, d)
    # index_select: far cheaper than [:, idx]
    own = q if g.rows_in_order else q.index_select(1, g.rows.view(-1))
    own = own.reshape(num_kv, group, b, r, d).transpose(1, 2)
    # A power-of-two scale is exact on q: (q*s)k has the bits of (qk)*s, one op less.
    exact_scale = math.frexp(scale)[0] == 0.5
    torch.mul(own, scale if exact_scale else 1.0, out=qf[:, :, :rows].view(num_kv, b, group, r, d))
    granules = g.key_granules.view(-1)
    keys = k_cache.view(num_kv, -1, granule * d).index_select(1, granules).view(num_kv * b, lk, d)
    scores = torch.bmm(qf.view(num_kv * b, padded, d), keys.transpose(1, 2)).view(num_kv, b, padded, lk)
    # In place from here (each new tensor costs as much as the arithmetic); padding rows see key 0.
    scores.masked_fill_(g.hidden, float("-inf"))
    if not exact_scale:
        scores.mul_(scale)
    weights = scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # [Hkv, B, P, Lk]
    if g.tiles is None:  # tile t: keys [t*KEY_TILE, (t+1)*KEY_TILE) as they stand
        parts = _tile_products(weights, v_cache, granules, granule, lk // KEY_TILE)
    else:
        tiles = g.tiles
        start = tiles.first * KEY_TILE
        parts = _tile_products(weights[..., :start], v_cache, tiles.prefix_granules, granule, tiles.first)
        nt, width = tiles.tile_keys.shape[1:]
        index = tiles.tile_keys.view(1, b, 1, nt * width).expand(num_kv, b, padded, nt * width)
        # [Hkv, B, P, nt*W]; the index past the keys ("none") reads the pad's 0
        w = torch.gather(F.pad(weights[..., start:], (0, 1)), 3, index)
        if tiles.keep is not None:
            w = w * tiles.keep.view(1, b, 1, nt * width)
        values = v_cache.index_select(1, tiles.tile_slots.view(-1))  # with the ones
        parts += _products(w.view(num_kv, b, padded, nt, width), values)
    acc, *rest = parts
    for part in rest:  # tiles in logical order: the same sums as decoding one row at a time
        acc = acc + part
    # Divided straight into the layout the output projection reads: [B, R, Hkv, G, D] = [B*R, Hq, D].
    out = q.new_empty(b, r, num_kv, group, d)
    num, den = acc[:, :, :rows, :d], acc[:, :, :rows, d:]  # [Hkv, B, G*R, D], [Hkv, B, G*R, 1]
    shape = (num_kv, b, group, r)
    torch.div(num.view(*shape, d), den.view(*shape, 1), out=out.permute(2, 0, 3, 1, 4))
    out = out.view(b * r, num_heads, d)
    return out if g.out_places is None else out[g.out_places]
