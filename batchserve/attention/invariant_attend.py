"""One group's attention products for the batch-invariant backend (`invariant.py` says why each
reduction is ordered as it is): the group's layout, its per-step scratch, the products."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchserve.attention.invariant_plan import KEY_TILE


@dataclass(frozen=True, slots=True)
class LayerPool:
    """One layer's K/V pool and the views a step reads it through, made once: each view made in
    a layer costs a dispatch. Keys and values are read in granules of g slots (`InvariantBackend`)."""

    keys: torch.Tensor  # [Hkv, S, D]
    values: torch.Tensor  # [Hkv, S, D+1]: each value with a 1 beside it (the softmax's denominator)
    new_values: torch.Tensor  # [Hkv, S, D] view: where a step's values are written
    key_granules: torch.Tensor  # [Hkv, S/g, g*D] view
    value_granules: torch.Tensor  # [Hkv, S/g, g*(D+1)] view
    group: int  # query heads per KV head
    granule: int

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, group: int, granule: int) -> LayerPool:
        kv_heads, _, d = keys.shape
        return cls(
            keys,
            values,
            values[..., :d],
            keys.view(kv_heads, -1, granule * d),
            values.view(kv_heads, -1, granule * (d + 1)),
            group,
            granule,
        )

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[2]


@dataclass(frozen=True, slots=True)
class Group:
    """Requests attended in one set of products, rows and keys padded to the group's largest."""

    rows: torch.Tensor  # [B*R] step row of each row place (padding: the request's first row)
    rows_in_order: bool  # rows are the step's rows 0..T-1 as they stand: q is read without a gather
    out_places: torch.Tensor | None  # [n] places (in the flattened [B, R]) holding real rows; None: all of them
    out_rows: torch.Tensor  # [n] their step rows
    key_granules: torch.Tensor  # [B*Lk/g] pool granule of each run of g keys (padding: the zero block's)
    # [B, P, Lk] over the product's rows (head-major, padded): 0 where a row may attend, -inf where not.
    # Added, not masked_fill_'ed: the same scores (s + 0 is s, a finite s - inf is -inf) at a
    # tenth of the cost. Keys past a request's own must be finite, as values always had to be
    # (0 times a NaN is NaN): the pool's are (zeros, or earlier requests' keys and values).
    hidden: torch.Tensor
    num_rows: int  # R: row places per request (its largest request's rows)
    # None where every request's keys are in logical order (decode rows, chunks, chains): tile t
    # is keys [t*KEY_TILE, (t+1)*KEY_TILE), read straight from the scores and the key granules.
    tiles: Tiles | None
    scratch: Scratch | None = None  # the step's, once its groups are planned; None: made in each layer


@dataclass(frozen=True, slots=True)
class Scratch:
    """A group's buffers and their views, made once per step and reused by every layer: each
    tensor or view made in a layer costs a dispatch (a 1-row decode layer made about 40 before).
    Every layer writes all it reads: q's real rows, the gathered keys and values, the scores and
    the value products. The step's groups share one storage per buffer (`scratch_storage`): they
    are attended one after another. A step's storage stays for its whole forward, so it is kept
    only while small (`SCRATCH_BYTES`); a step that needs more (long prompt chunks, long contexts,
    where one more allocation a layer costs nothing next to the arithmetic) makes each layer's
    buffers as it goes, as `attend` does for a group without one."""

    q_rows: torch.Tensor  # [Hkv, G, B, R, D] view of q's real rows: where q (times the scale) lands
    q: torch.Tensor  # [Hkv*B, P, D] the score product's rows (each KV head's G*R rows, then padding)
    keys: torch.Tensor  # [Hkv, B*Lk/g, g*D] the keys as gathered granule by granule
    keys_t: torch.Tensor  # [Hkv*B, D, Lk] view: the score product's right side
    scores: torch.Tensor  # [Hkv*B, P, Lk]
    weights: torch.Tensor  # [Hkv, B, P, Lk] view of the scores (softmax numerators in place)
    values: torch.Tensor | None  # [Hkv, B*nt*W/g, g*(D+1)] keys-in-order groups: values gathered by granule
    values_t: torch.Tensor | None  # [Hkv*B*nt, W, D+1] view: the value products' right side
    # [Hkv, B, nt, P, W] view of the scores tile-major, and the buffer it is copied into as the
    # value products' left side [Hkv*B*nt, P, W] (keys-in-order groups)
    weights_by_tile: torch.Tensor | None
    tiles: torch.Tensor | None
    parts: torch.Tensor | None  # [Hkv*B*nt, P, D+1] the value products, tile by tile
    tile_parts: tuple[torch.Tensor, ...]  # nt views [Hkv, B, P, D+1] of `parts`, the first the running sum
    # Views of the running sum: its real rows' weighted values [Hkv, B, G, R, D] and denominators
    # [Hkv, B, G, R, 1] (keys-in-order groups).
    num: torch.Tensor | None
    den: torch.Tensor | None


def _buffer_shapes(g: Group, pool: LayerPool) -> dict[str, tuple[int, ...]]:
    """The shape of each of group g's buffers."""
    kv_heads, d, granule = pool.num_kv_heads, pool.head_dim, pool.granule
    b, padded, lk = g.hidden.shape
    shapes = {"q": (kv_heads, b, padded, d), "keys": (kv_heads, b * lk // granule, granule * d)}
    shapes["scores"] = (kv_heads * b, padded, lk)
    if g.tiles is None:  # keys in logical order: values gathered by granule too
        shapes["values"] = (kv_heads, b * lk // granule, granule * (d + 1))
        shapes["tiles"] = (kv_heads * b * (lk // KEY_TILE), padded, KEY_TILE)
        shapes["parts"] = (kv_heads * b * (lk // KEY_TILE), padded, d + 1)
    return shapes


# The most a step keeps in scratch for its whole forward (see `Scratch`): a batch-1 decode at an
# 8k context needs about 13 MiB, 16 requests at 2k about 50.
SCRATCH_BYTES = 64 << 20


def scratch_storage(groups: Sequence[Group], pool: LayerPool, limit: int | None) -> dict[str, torch.Tensor] | None:
    """One flat tensor per buffer, each as large as that buffer's largest group needs (pool: one
    layer's, for the heads, head dim, dtype and device); None past `limit` bytes. q's storage is
    zeroed, though nothing depends on it: a padding row of the score product may hold what
    another group wrote there, a product row's bits do not depend on the other rows
    (`kernels_invariant`), and a padding row sees key 0 only and is dropped."""
    sizes: dict[str, int] = {}
    for g in groups:
        for kind, shape in _buffer_shapes(g, pool).items():
            sizes[kind] = max(sizes.get(kind, 0), math.prod(shape))
    if limit is not None and sum(sizes.values()) * pool.keys.element_size() > limit:
        return None
    storage = {kind: pool.keys.new_empty(n) for kind, n in sizes.items()}
    if "q" in storage:  # a step without requests has no groups
        storage["q"].zero_()
    return storage


def make_scratch(g: Group, storage: dict[str, torch.Tensor], pool: LayerPool) -> Scratch:
    """Group g's scratch: views of `storage` (`scratch_storage`) for a layer pool's shapes."""
    kv_heads, group, d = pool.num_kv_heads, pool.group, pool.head_dim
    b, padded, lk = g.hidden.shape
    r, nt = g.num_rows, lk // KEY_TILE
    view = {kind: storage[kind][: math.prod(shape)].view(shape) for kind, shape in _buffer_shapes(g, pool).items()}
    q, keys, scores = view["q"], view["keys"], view["scores"]
    values, tiles, parts = view.get("values"), view.get("tiles"), view.get("parts")
    tile_parts = () if parts is None else tuple(parts.view(kv_heads, b, nt, padded, d + 1).unbind(2))
    shape = (kv_heads, b, group, r)
    return Scratch(
        q_rows=q[:, :, : group * r].view(kv_heads, b, group, r, d).transpose(1, 2),
        q=q.view(kv_heads * b, padded, d),
        keys=keys,
        keys_t=keys.view(kv_heads * b, lk, d).transpose(1, 2),
        scores=scores,
        weights=scores.view(kv_heads, b, padded, lk),
        values=values,
        values_t=None if values is None else values.view(kv_heads * b * nt, KEY_TILE, d + 1),
        weights_by_tile=None if tiles is None else scores.view(kv_heads, b, padded, nt, KEY_TILE).transpose(2, 3),
        tiles=tiles,
        parts=parts,
        tile_parts=tile_parts,
        num=tile_parts[0][:, :, : group * r, :d].view(*shape, d) if tile_parts else None,
        den=tile_parts[0][:, :, : group * r, d:].view(*shape, 1) if tile_parts else None,
    )


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


def _tile_products(weights: torch.Tensor, pool: LayerPool, granules: torch.Tensor, nt: int) -> list[torch.Tensor]:
    """The value products of `nt` tiles whose keys stand in logical order: weights [Hkv, B, P,
    nt*KEY_TILE] (a view), values read from the pool by granule (`granules`: [B * nt*KEY_TILE/g])."""
    if nt == 0:
        return []
    num_kv, b, padded, _ = weights.shape
    values = pool.value_granules.index_select(1, granules)  # [Hkv, B*nt*W/g, g*(D+1)]
    return _products(weights.view(num_kv, b, padded, nt, KEY_TILE), values)


def _products(w: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
    """Per tile, weights w [Hkv, B, P, nt, W] times its values (`values`: [Hkv, B*nt*W, D+1] in
    any view of that size): nt partial sums [Hkv, B, P, D+1], each over its tile's keys in order."""
    num_kv, b, padded, nt, width = w.shape
    w = w.permute(0, 1, 3, 2, 4).reshape(num_kv * b * nt, padded, width)
    parts = torch.bmm(w, values.reshape(num_kv * b * nt, width, -1))  # [Hkv*B*nt, P, D+1]
    return list(parts.view(num_kv, b, nt, padded, -1).unbind(2))


def attend(q: torch.Tensor, pool: LayerPool, g: Group, scale: float) -> torch.Tensor:
    """[n, Hq, D]: the group's real rows of q [Hq, T, D] attended over its keys in one layer's
    pool, into the group's scratch (see `Scratch`; the products write into it)."""
    kv_heads, group, d = pool.num_kv_heads, pool.group, pool.head_dim
    b, r = g.hidden.shape[0], g.num_rows
    sc = g.scratch
    if sc is None:  # a step too large to keep scratch for its whole forward: this layer's own
        storage = scratch_storage((g,), pool, limit=None)
        assert storage is not None
        sc = make_scratch(g, storage, pool)
    own = q if g.rows_in_order else q.index_select(1, g.rows)  # index_select: far cheaper than [:, idx]
    # A power-of-two scale is exact on q: (q*s)k has the bits of (qk)*s, one op less.
    exact_scale = math.frexp(scale)[0] == 0.5
    torch.mul(own.reshape(kv_heads, group, b, r, d), scale if exact_scale else 1.0, out=sc.q_rows)
    torch.index_select(pool.key_granules, 1, g.key_granules, out=sc.keys)
    torch.bmm(sc.q, sc.keys_t, out=sc.scores)  # [Hkv*B, P, Lk]
    # In place from here (each new tensor costs as much as the arithmetic); padding rows see key 0.
    weights = sc.weights.add_(g.hidden)  # [Hkv, B, P, Lk]
    if not exact_scale:
        weights.mul_(scale)
    weights.sub_(weights.amax(-1, keepdim=True)).exp_()
    if g.tiles is None:  # tile t: keys [t*KEY_TILE, (t+1)*KEY_TILE) as they stand
        _in_order_products(sc, pool, g.key_granules)
        num, den = sc.num, sc.den
    else:
        acc = _tree_products(weights, pool, g.tiles)
        rows, shape = group * r, (kv_heads, b, group, r)
        num, den = acc[:, :, :rows, :d].view(*shape, d), acc[:, :, :rows, d:].view(*shape, 1)
    # Divided straight into the layout the output projection reads: [B, R, Hkv, G, D] = [B*R, Hq, D]
    # (a new tensor each layer: a caller may keep every layer's output).
    out = q.new_empty(b * r, kv_heads * group, d)
    torch.div(num, den, out=out.view(b, r, kv_heads, group, d).permute(2, 0, 3, 1, 4))
    return out if g.out_places is None else out[g.out_places]


def _in_order_products(sc: Scratch, pool: LayerPool, granules: torch.Tensor) -> torch.Tensor:
    """[Hkv, B, P, D+1]: the value products of a group whose keys stand in logical order, tile
    by tile into the scratch, the tiles' partial sums added in tile order into the first."""
    assert sc.values is not None and sc.values_t is not None and sc.parts is not None
    assert sc.tiles is not None and sc.weights_by_tile is not None
    torch.index_select(pool.value_granules, 1, granules, out=sc.values)
    sc.tiles.view(sc.weights_by_tile.shape).copy_(sc.weights_by_tile)  # tile-major: each tile's weights a matrix
    torch.bmm(sc.tiles, sc.values_t, out=sc.parts)  # [Hkv*B*nt, P, D+1]
    return _sum_tiles(sc.tile_parts)


def _tree_products(weights: torch.Tensor, pool: LayerPool, tiles: Tiles) -> torch.Tensor:
    """[Hkv, B, P, D+1]: the value products of a group with draft trees: the leading tiles'
    committed keys read by granule as they stand, the later tiles gathered key by key."""
    num_kv, b, padded, _ = weights.shape
    start = tiles.first * KEY_TILE
    parts = _tile_products(weights[..., :start], pool, tiles.prefix_granules, tiles.first)
    nt, width = tiles.tile_keys.shape[1:]
    index = tiles.tile_keys.view(1, b, 1, nt * width).expand(num_kv, b, padded, nt * width)
    # [Hkv, B, P, nt*W]; the index past the keys ("none") reads the pad's 0
    w = torch.gather(F.pad(weights[..., start:], (0, 1)), 3, index)
    if tiles.keep is not None:
        w = w * tiles.keep.view(1, b, 1, nt * width)
    values = pool.values.index_select(1, tiles.tile_slots.view(-1))  # with the ones
    parts += _products(w.view(num_kv, b, padded, nt, width), values)
    return _sum_tiles(parts)


def _sum_tiles(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tiles' partial sums [Hkv, B, P, D+1] added in tile (logical) order into the first, in
    place: the same sums as decoding one row at a time, in a decode group and a tree group alike."""
    acc, *rest = parts
    for part in rest:
        acc.add_(part)
    return acc
