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

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from batchserve.attention.base import AttentionBackend, LayerAttention, StepLayout
from batchserve.attention.invariant_attend import (
    SCRATCH_BYTES,
    Group,
    LayerPool,
    Tiles,
    attend,
    make_scratch,
    scratch_storage,
)
from batchserve.attention.invariant_plan import KEY_TILE, MIN_KEYS, group_requests, product_rows, tiles_of
from batchserve.attention.torch_ref import copy_pool_slots


@dataclass(frozen=True, slots=True)
class InvariantMetadata:
    backend: InvariantBackend
    slot_mapping: torch.Tensor  # [T]
    groups: tuple[Group, ...]
    num_tokens: int
    in_order: bool  # one group whose real rows are the step's rows in order: its output is the step's
    # The same groups for each sliding window of the model's layers: only which keys are hidden differs.
    windowed: dict[int, tuple[Group, ...]] = dataclasses.field(default_factory=dict)


class InvariantBackend(AttentionBackend):
    """A head-major paged pool ([layers, Hkv, slots, D], as the torch reference's) plus a zero
    block at its end, the values stored with a column of ones; attention computed
    batch-invariantly (above). Keys (and, where tiles are
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
        *,
        row_block: int,
    ) -> None:
        """`row_block`: rows a product takes at a time, the smallest this CPU's kernels keep
        invariant (`invariant_check.checked_backend` measures it once and builds the backend)."""
        self.block_size = block_size
        self.device = torch.device(device)
        self.timed = self.device.type == "cpu"  # it computes on the host's clock
        self.group = (num_qo_heads or num_kv_heads) // num_kv_heads  # query heads per KV head
        self.row_block = row_block
        self.scratch_bytes = SCRATCH_BYTES  # the most a step keeps in scratch for its forward (`Scratch`)
        self.num_blocks = num_blocks
        self.granule = math.gcd(block_size, KEY_TILE)
        self.zero_slot = slots = num_blocks * block_size  # the zero block's first slot
        size = slots + block_size
        self.k_cache = torch.zeros(num_layers, num_kv_heads, size, head_dim, dtype=dtype, device=device)
        self.v_cache = torch.zeros(num_layers, num_kv_heads, size, head_dim + 1, dtype=dtype, device=device)
        self.v_cache[:, :, :slots, head_dim] = 1.0  # the denominator's column
        # Each layer's views, made once (a step would make 150 of them).
        self.pools = [LayerPool.of(k, v, self.group, self.granule) for k, v in zip(self.k_cache, self.v_cache)]
        self._sinks: list[torch.Tensor | None] = []  # each layer's sinks [Hq] (`set_layers`)

    def set_layers(self, layers: tuple[LayerAttention, ...]) -> None:
        super().set_layers(layers)
        # Each layer's sinks [Hq] as `attend` reads them (gpt-oss), made once.
        self._sinks = [
            None if s.sinks is None else torch.tensor(s.sinks, dtype=self.k_cache.dtype, device=self.device)
            for s in layers
        ]

    def build_metadata(self, step: StepLayout, slot_mapping: torch.Tensor) -> InvariantMetadata:
        members = group_requests(step.q_len, step.kv_len)
        plans = [self._group(step, m) for m in members]
        pool = self.pools[0]
        storage = scratch_storage(plans, pool, self.scratch_bytes)
        if storage is not None:
            plans = [dataclasses.replace(g, scratch=make_scratch(g, storage, pool)) for g in plans]
        groups = tuple(plans)
        t = step.num_tokens
        in_order = len(groups) == 1 and torch.equal(groups[0].out_rows.cpu(), torch.arange(t))
        windowed = {w: tuple(self._windowed(step, g, m, w) for g, m in zip(groups, members)) for w in self.windows}
        return InvariantMetadata(self, slot_mapping.to(self.device), groups, t, in_order, windowed)

    def _windowed(self, step: StepLayout, g: Group, members: list[int], window: int) -> Group:
        """Group g with the keys outside each row's sliding window hidden too (zero weight, as a
        sibling branch's: the sums stay those of the row's own keys)."""
        b, _, lk = g.hidden.shape
        hidden = g.hidden.clone()
        shown = torch.zeros(b, g.num_rows, lk, dtype=torch.bool)
        for j, i in enumerate(members):
            inside = step.in_window(i, window)
            if inside is not None:
                shown[j, : inside.shape[0], : inside.shape[1]] = ~torch.from_numpy(inside)
        outside = torch.from_numpy(product_rows(shown.numpy(), self.group, self.row_block)).to(self.device)
        hidden.masked_fill_(outside, float("-inf"))
        return dataclasses.replace(g, hidden=hidden)

    def _group(self, step: StepLayout, members: list[int]) -> Group:
        b, g = len(members), self.granule
        q_len, kv_len = step.q_len[members], step.kv_len[members]
        r = int(q_len.max())
        positions = [np.concatenate((np.arange(step.num_cached[i]), step.row_positions(i))) for i in members]
        in_order = all(np.array_equal(p, np.arange(len(p))) for p in positions)
        # A draft tree's gathered tiles read their empty places from the last key, hidden from
        # every row: keys reach one past the longest request's.
        lk = max(MIN_KEYS, -(-(int(kv_len.max()) + (not in_order)) // KEY_TILE) * KEY_TILE)
        rows = np.zeros((b, r), np.int64)
        granules = np.full((b, lk // g), self.zero_slot // g, np.int64)
        mask = np.zeros((b, r, lk), bool)
        for j, i in enumerate(members):
            start, q, kv, cached = int(step.qo_indptr[i]), int(q_len[j]), int(kv_len[j]), int(step.num_cached[i])
            rows[j] = start
            rows[j, :q] = start + np.arange(q)
            used = -(-kv // g)  # past kv the granule's slots are masked (zero weight): any finite keys and values do
            granules[j, :used] = step.pool_slots(i, np.arange(used) * g, self.block_size) // g
            mask[j, :q, :cached] = True
            mask[j, :q, cached:kv] = step.step_mask(i) if q > 1 else True
            mask[j, q:, 0] = True  # padding rows
        real = (np.arange(r)[None, :] < q_len[:, None]).reshape(-1)
        dev = self.device
        hidden = product_rows(~mask, self.group, self.row_block)  # [B, P, Lk]
        return Group(
            rows=torch.from_numpy(rows.reshape(-1)).to(dev),
            rows_in_order=rows.size == step.num_tokens and bool((rows.reshape(-1) == np.arange(rows.size)).all()),
            out_places=None if real.all() else torch.from_numpy(np.flatnonzero(real)).to(dev),
            out_rows=torch.from_numpy(rows.reshape(-1)[real]).to(dev),
            key_granules=torch.from_numpy(granules.reshape(-1)).to(dev),
            hidden=torch.from_numpy(np.where(hidden, np.float32(-np.inf), np.float32(0.0))).to(dev, self.k_cache.dtype),
            num_rows=r,
            tiles=None if in_order else self._tiles(step, members, positions, lk, granules),
        )

    def _tiles(
        self, step: StepLayout, members: list[int], positions: list[np.ndarray], lk: int, granules: np.ndarray
    ) -> Tiles:
        """Tiles of a group whose keys are not all in logical order (draft trees)."""
        b = len(members)
        # Tiles that hold only committed keys in every request: their keys stand in logical order.
        first = min(int(step.num_cached[i]) for i in members) // KEY_TILE
        start = first * KEY_TILE  # the later tiles' indexes count from here
        tiles = [tuple(x[first:] for x in tiles_of(p)) for p in positions]
        nt, width = max(t[0].shape[0] for t in tiles), max(t[0].shape[1] for t in tiles)
        none = lk - 1  # past every request's keys: zero weight in every row, the zero block's value
        keys = np.full((b, lk), self.zero_slot, np.int64)
        tile_keys = np.full((b, nt, width), none, np.int64)
        keep = np.zeros((b, nt, width), np.float32)
        shared = False  # whether some span holds keys of two tiles
        for j, i in enumerate(members):
            kv = int(step.kv_len[i])
            keys[j, :kv] = step.pool_slots(i, np.arange(kv), self.block_size)
            index, own = tiles[j]
            tile_keys[j, : index.shape[0], : index.shape[1]] = np.where(index < kv, index, none)
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

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_pool_slots((self.k_cache, self.v_cache), src, dst)

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
        pool = self.pools[layer_idx]
        pool.keys.index_copy_(1, metadata.slot_mapping, k)  # k: [Hkv, T, D]
        pool.new_values.index_copy_(1, metadata.slot_mapping, v)
        spec = self.layer(layer_idx)
        groups = metadata.groups if spec.window is None else metadata.windowed[spec.window]
        sinks = self._sinks[layer_idx] if self._sinks else None
        if metadata.in_order:  # one group, the step's rows in order (decode steps): no scatter
            out = attend(q, pool, groups[0], scale, spec.softcap, sinks)
        else:
            out = q.new_empty(metadata.num_tokens, q.shape[0], q.shape[2])  # [T, Hq, D]
            for g in groups:
                out[g.out_rows] = attend(q, pool, g, scale, spec.softcap, sinks)
        self.seconds += time.perf_counter() - t0
        return out  # [T, Hq, D], contiguous
