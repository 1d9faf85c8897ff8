"""One group's attention products for the batch-invariant backend (`invariant.py` says why each
reduction is ordered as it is): the group's layout, its per-step scratch, the products."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchserve.attention.invariant_plan import KEY_TILE
from batchserve.threads import rows_whole


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
class Tiles:
    """Value tiles of a group with draft trees. The first `first` tiles hold every request's
    committed keys in logical order (a draft node's position is past its request's prefix): they
    are read as they stand, by granule, like a decode group's. The tiles from `first` on are
    gathered key by key; their indexes count from key `first * KEY_TILE`."""

    first: int
    prefix_granules: torch.Tensor  # [B * first * KEY_TILE / g] pool granules of the leading tiles' keys
    tile_slots: torch.Tensor  # [B, nt, W] pool slot of each later tile place (past a span: the zero slot)
    tile_keys: torch.Tensor  # [B, nt, W] the same as an index into the keys from `first` on (past a span: the last key)
    keep: torch.Tensor | None  # [B, nt, W] float 0/1, where a span holds keys of two tiles


@dataclass(frozen=True, slots=True)
class ByGranule:
    """Value tiles whose keys stand in logical order (all of a decode group's, a tree group's
    leading ones): weights copied tile-major out of the scores, values read by granule."""

    granules: torch.Tensor  # [B*nt*W/g] pool granules of the tiles' keys
    values: torch.Tensor  # [Hkv, B*nt*W/g, g*(D+1)]
    values_t: torch.Tensor  # [Hkv*B*nt, W, D+1] view: the products' right side
    weights: torch.Tensor  # [Hkv, B, nt, P, W] view of the scores, tile-major
    tiles: torch.Tensor  # [Hkv*B*nt, P, W] the products' left side (the weights copied)
    tiles_major: torch.Tensor  # [Hkv, B, nt, P, W] view of `tiles`: where the weights are copied
    parts: torch.Tensor  # [Hkv*B*nt, P, D+1]


@dataclass(frozen=True, slots=True)
class Gathered:
    """A tree group's later value tiles, gathered key by key from the scores and the pool."""

    source: torch.Tensor  # [Hkv, B, P, nt, Lk - start] view: the scores from `first`'s key on, per tile
    index: torch.Tensor  # [Hkv, B, P, nt, W] view: each tile place's key in `source`
    tiles: torch.Tensor  # [Hkv*B*nt, P, W] the products' left side
    tiles_major: torch.Tensor  # [Hkv, B, nt, P, W] view of `tiles`
    tiles_out: torch.Tensor  # [Hkv, B, P, nt, W] view of `tiles`: where the gather writes
    keep: torch.Tensor | None  # [1, B, nt, 1, W] view of `Tiles.keep`
    slots: torch.Tensor  # [B*nt*W] pool slot of each tile place
    values: torch.Tensor  # [Hkv, B*nt*W, D+1]
    values_t: torch.Tensor  # [Hkv*B*nt, W, D+1] view
    parts: torch.Tensor  # [Hkv*B*nt, P, D+1]


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
    by_granule: ByGranule | None  # None: a tree group with no tile of committed keys only
    gathered: Gathered | None  # None: keys in logical order (decode rows, chunks, chains)
    tile_parts: tuple[torch.Tensor, ...]  # every tile's products [Hkv, B, P, D+1] in logical order
    # Views of the first tile's products, the running sum: its real rows' weighted values
    # [Hkv, B, G, R, D] and denominators [Hkv, B, G, R, 1].
    num: torch.Tensor
    den: torch.Tensor


def _counts(g: Group) -> tuple[int, int, int]:
    """(tiles read by granule, tiles gathered, a gathered tile's width W) of group g."""
    lk = g.hidden.shape[2]
    if g.tiles is None:
        return lk // KEY_TILE, 0, 0
    return g.tiles.first, *g.tiles.tile_keys.shape[1:]


def _buffer_shapes(g: Group, pool: LayerPool) -> dict[str, tuple[int, ...]]:
    """The shape of each of group g's buffers."""
    kv_heads, d, granule = pool.num_kv_heads, pool.head_dim, pool.granule
    b, padded, lk = g.hidden.shape
    shapes = {"q": (kv_heads, b, padded, d), "keys": (kv_heads, b * lk // granule, granule * d)}
    shapes["scores"] = (kv_heads * b, padded, lk)
    ordered, nt, width = _counts(g)
    if ordered:
        shapes["values"] = (kv_heads, b * ordered * KEY_TILE // granule, granule * (d + 1))
        shapes["tiles"] = (kv_heads * b * ordered, padded, KEY_TILE)
        shapes["parts"] = (kv_heads * b * ordered, padded, d + 1)
    if nt:
        shapes["gathered_tiles"] = (kv_heads * b * nt, padded, width)
        shapes["gathered_values"] = (kv_heads, b * nt * width, d + 1)
        shapes["gathered_parts"] = (kv_heads * b * nt, padded, d + 1)
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
    r = g.num_rows
    view = {kind: storage[kind][: math.prod(shape)].view(shape) for kind, shape in _buffer_shapes(g, pool).items()}
    q, keys, scores = view["q"], view["keys"], view["scores"]
    weights = scores.view(kv_heads, b, padded, lk)
    ordered, nt, width = _counts(g)
    by_granule = gathered = None
    tile_parts: tuple[torch.Tensor, ...] = ()
    if ordered:
        parts = view["parts"]
        by_granule = ByGranule(
            granules=g.key_granules if g.tiles is None else g.tiles.prefix_granules,
            values=view["values"],
            values_t=view["values"].view(kv_heads * b * ordered, KEY_TILE, d + 1),
            weights=weights.view(kv_heads, b, padded, lk // KEY_TILE, KEY_TILE)[:, :, :, :ordered].transpose(2, 3),
            tiles=view["tiles"],
            tiles_major=view["tiles"].view(kv_heads, b, ordered, padded, KEY_TILE),
            parts=parts,
        )
        tile_parts = tuple(parts.view(kv_heads, b, ordered, padded, d + 1).unbind(2))
    if nt:
        assert g.tiles is not None
        start, tiles, parts = ordered * KEY_TILE, view["gathered_tiles"], view["gathered_parts"]
        keep, major = g.tiles.keep, tiles.view(kv_heads, b, nt, padded, width)
        gathered = Gathered(
            source=weights[..., start:].unsqueeze(3).expand(kv_heads, b, padded, nt, lk - start),
            index=g.tiles.tile_keys.view(1, b, 1, nt, width).expand(kv_heads, b, padded, nt, width),
            tiles=tiles,
            tiles_major=major,
            tiles_out=major.transpose(2, 3),
            keep=None if keep is None else keep.view(1, b, nt, 1, width),
            slots=g.tiles.tile_slots.view(-1),
            values=view["gathered_values"],
            values_t=view["gathered_values"].view(kv_heads * b * nt, width, d + 1),
            parts=parts,
        )
        tile_parts += tuple(parts.view(kv_heads, b, nt, padded, d + 1).unbind(2))
    shape = (kv_heads, b, group, r)
    return Scratch(
        q_rows=q[:, :, : group * r].view(kv_heads, b, group, r, d).transpose(1, 2),
        q=q.view(kv_heads * b, padded, d),
        keys=keys,
        keys_t=keys.view(kv_heads * b, lk, d).transpose(1, 2),
        scores=scores,
        weights=weights,
        by_granule=by_granule,
        gathered=gathered,
        tile_parts=tile_parts,
        num=tile_parts[0][:, :, : group * r, :d].view(*shape, d),
        den=tile_parts[0][:, :, : group * r, d:].view(*shape, 1),
    )


def sink_rows(sinks: torch.Tensor, g: Group, pool: LayerPool) -> torch.Tensor:
    """[Hkv, 1, P, 1]: each product row's sink (`sinks` [Hq], head-major as q's rows are laid out:
    KV head, then its G query heads, each R rows); -inf on padding rows."""
    kv_heads, group = pool.num_kv_heads, pool.group
    padded, r = g.hidden.shape[1], g.num_rows
    rows = sinks.view(kv_heads, group, 1).expand(kv_heads, group, r).reshape(kv_heads, group * r)
    out = rows.new_full((kv_heads, 1, padded, 1), float("-inf"))
    out[:, 0, : group * r, 0] = rows
    return out


def _softmax_numerators(
    weights: torch.Tensor, g: Group, pool: LayerPool, sinks: torch.Tensor | None
) -> torch.Tensor | None:
    """Each row's scores [Hkv, B, P, Lk] into exp(s - max) in place, the max over its keys and
    its head's sink (`sinks` [Hq]); the sink's exp(sink - max) [Hkv, B, P, 1] (None without)."""
    top = weights.amax(-1, keepdim=True)  # [Hkv, B, P, 1]
    sink = None
    if sinks is not None:
        sink = sink_rows(sinks, g, pool)
        top = torch.maximum(top, sink)
        sink = (sink - top).exp_()  # the sink's share of each row's denominator
    weights.sub_(top).exp_()
    return sink


def attend(
    q: torch.Tensor,
    pool: LayerPool,
    g: Group,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[n, Hq, D]: the group's real rows of q [Hq, T, D] attended over its keys in one layer's
    pool, into the group's scratch (see `Scratch`; the products write into it). `softcap`: each
    scaled score s becomes softcap * tanh(s / softcap) before the mask (elementwise: a score's
    bits are its own). `sinks` [Hq] (gpt-oss): each head's logit joins its rows' max and adds
    exp(sink - max) to their denominators, with no value (row by row: the bits stay a row's own)."""
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
    weights = sc.weights  # [Hkv, B, P, Lk]
    with rows_whole(kv_heads * b * weights.shape[2], weights.shape[3]):  # tanh, exp: each row on one thread
        if softcap is not None:  # scaled, capped, then masked, as the model's own attention does
            if not exact_scale:
                weights.mul_(scale)
            weights.div_(softcap).tanh_().mul_(softcap).add_(g.hidden)
        else:
            weights.add_(g.hidden)
            if not exact_scale:
                weights.mul_(scale)
        sink = _softmax_numerators(weights, g, pool, sinks)
    if sc.by_granule is not None:  # tile t: keys [t*KEY_TILE, (t+1)*KEY_TILE) as they stand
        t = sc.by_granule
        torch.index_select(pool.value_granules, 1, t.granules, out=t.values)
        t.tiles_major.copy_(t.weights)  # tile-major: each tile's weights one matrix
        torch.bmm(t.tiles, t.values_t, out=t.parts)  # [Hkv*B*nt, P, D+1]
    if sc.gathered is not None:  # a draft tree's tiles, key by key
        t = sc.gathered
        torch.gather(t.source, 4, t.index, out=t.tiles_out)
        if t.keep is not None:
            t.tiles_major.mul_(t.keep)
        torch.index_select(pool.values, 1, t.slots, out=t.values)  # with the ones
        torch.bmm(t.tiles, t.values_t, out=t.parts)
    acc, *rest = sc.tile_parts  # summed in tile (logical) order into the first, in place: the same
    for part in rest:  # sums as decoding one row at a time, in a decode group and a tree group alike
        acc.add_(part)
    if sink is not None:  # after the keys' sum, in every group alike
        sc.den.add_(sink[:, :, : group * r].view(kv_heads, b, group, r, 1))
    # Divided straight into the layout the output projection reads: [B, R, Hkv, G, D] = [B*R, Hq, D]
    # (a new tensor each layer: a caller may keep every layer's output).
    out = q.new_empty(b * r, kv_heads * group, d)
    torch.div(sc.num, sc.den, out=out.view(b, r, kv_heads, group, d).permute(2, 0, 3, 1, 4))
    return out if g.out_places is None else out[g.out_places]
