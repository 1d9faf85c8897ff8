"""How the invariant attention lays out a step: which requests share products, their padded rows, their value tiles.

Pure numpy planning for `invariant.py` (the reasons for each rule are in its header)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np

ROW_BLOCKS = (4, 8)  # rows of a product are padded to a multiple of the first that passes the check
MIN_KEYS = KEY_TILE = 64  # keys of a score product, at least; logical positions per value product
# Keys of other branches a tile may hold between a row's own: past this a request's draft rows
# stay exact but may lose bit-equality with decoding (a product over more keys blocks them).
MAX_SPREAD = 128
GROUP_ROWS = 16  # requests with at most this many rows this step are attended together
# What one more set of products per layer costs, in padded request rows: its ~20 small ops
# against the share of the score and value products a padded row adds (measured on SmolLM2's
# shapes: benchmarks/README.md).
GROUP_COST_ROWS = 10


def group_requests(q_len: np.ndarray, kv_len: np.ndarray) -> list[list[int]]:
    """Which requests share a set of products: those with at most GROUP_ROWS rows, by key count
    rounded up to a power of two (one long context must not pad every short one to its length),
    then by row count (`split_by_rows`); a request with more rows (a prompt chunk) alone."""
    by_keys: dict[int, list[int]] = {}
    alone = []
    for i, (q, kv) in enumerate(zip(q_len.tolist(), kv_len.tolist())):
        if q > GROUP_ROWS:
            alone.append([i])
        else:
            by_keys.setdefault(max(KEY_TILE, 1 << (kv - 1).bit_length()), []).append(i)
    return [g for k in sorted(by_keys) for g in split_by_rows(by_keys[k], q_len)] + alone


def split_by_rows(members: list[int], q_len: np.ndarray) -> list[list[int]]:
    """`members` cut into groups of similar row counts, each in step order. A group pads every
    request to its largest (decode roots beside one draft tree would each pay for the tree's
    rows in the score and value products), and each group costs a set of products per layer
    (GROUP_COST_ROWS): the cuts of the members sorted by rows that minimise the two together,
    by dynamic programming over the distinct row counts (at most GROUP_ROWS of them)."""
    q = {i: int(q_len[i]) for i in members}
    counts = Counter(q.values())
    if len(counts) == 1:  # every request the same rows (decode steps): nothing to pad
        return [members]
    rows = sorted(counts)
    below = list(itertools.accumulate((counts[r] for r in rows), initial=0))  # below[j]: members in rows[:j]
    best = [0.0] + [math.inf] * len(rows)  # best[j]: cost of the members with the j smallest row counts
    cut = [0] * (len(rows) + 1)
    for j in range(1, len(rows) + 1):
        for i in range(j):  # one group of row counts rows[i:j], padded to rows[j - 1]; ties: fewer groups
            cost = best[i] + GROUP_COST_ROWS + (below[j] - below[i]) * rows[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(rows)
    while j > 0:
        lo, hi = rows[cut[j]], rows[j - 1]
        groups.append([i for i in members if lo <= q[i] <= hi])
        j = cut[j]
    return groups[::-1]


def product_rows(hidden: np.ndarray, group: int, row_block: int) -> np.ndarray:
    """[B, R, Lk] -> [B, P, Lk]: the rows as the score product lays them out (each of the group's
    query heads' rows in turn, padded to a multiple of `row_block` rows that see key 0 only)."""
    b, r, lk = hidden.shape
    padded = -(-group * r // row_block) * row_block
    out = np.ones((b, padded, lk), bool)
    out[:, :, 0] = False
    out[:, : group * r] = np.tile(hidden, (1, group, 1))
    return out


def tiles_of(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index [nt, W], keep [nt, W]) for keys at logical `positions` [L] (prefix, then this step's
    rows): tile t holds the keys at positions [t*KEY_TILE, (t+1)*KEY_TILE), gathered from the span
    of keys they lie in; index L marks places past the span. A draft tree's keys of two tiles can
    share a span: `keep` (0/1) tells each tile's own."""
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
    return index, keep
