"""A draft tree (`DraftTree`: tokens, parents, the ancestor masks) and a Jacobi window
(`WindowRows`), with the masks the attention reads (the package's docstring says who reads them)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The longest match a tree reports (`DraftTree.match`): past a few dozen tokens a copy is a copy.
MATCH_CAP = 32


def ancestor_mask(parents: Sequence[int | None]) -> np.ndarray:
    """[n, n] bool: row i is True at node i's ancestors (the root excluded) and at i itself.

    Nodes are in topological order. Up to 62 nodes each row is built as the bits of one integer
    (its parent's and its own) and unpacked in one vectorized step; larger trees take one
    vectorized pass per tree level.
    """
    n = len(parents)
    if n <= 62:
        bits: list[int] = []
        for i, q in enumerate(parents):
            bits.append(1 << i if q is None else bits[q] | 1 << i)
        return ((np.array(bits, np.int64)[:, None] >> np.arange(n)) & 1).astype(bool)
    mask = np.eye(n, dtype=bool)
    by_depth: list[tuple[list[int], list[int]]] = []  # per depth below the root's children: (nodes, parents)
    depth: list[int] = []
    for i, q in enumerate(parents):  # parents precede children
        depth.append(0 if q is None else depth[q] + 1)
        if q is not None:
            while len(by_depth) < depth[i]:
                by_depth.append(([], []))
            by_depth[depth[i] - 1][0].append(i)
            by_depth[depth[i] - 1][1].append(q)
    for rows, pars in by_depth:
        mask[rows] |= mask[pars]
    return mask


def spec_mask(tree: np.ndarray | None, window: np.ndarray | None) -> np.ndarray | None:
    """[d + w, d + w] bool over a request's draft nodes, then its window rows: each block keeps
    its own mask and neither sees the other (a window row is no node's ancestor, nor the reverse)."""
    if window is None or tree is None:
        return tree if window is None else window
    d, w = len(tree), len(window)
    mask = np.zeros((d + w, d + w), dtype=bool)
    mask[:d, :d], mask[d:, d:] = tree, window
    return mask


@dataclass(frozen=True, slots=True)
class DraftTree:
    """A tree of draft tokens hanging off the request's last accepted token (the root).

    `parents[i]` is the index of node i's parent, or None for a child of the root. Nodes are
    in topological order (a parent precedes its children) and siblings carry distinct tokens,
    so greedy verification can follow at most one child per step.
    """

    tokens: tuple[int, ...]
    parents: tuple[int | None, ...]
    # The drafter's estimate, per node, that the node ends up on the accepted path (e.g. the
    # trie's n-gram frequency of the path); empty when the drafter has none. Never above the
    # parent's: a node cannot be accepted without its parent.
    scores: tuple[float, ...] = ()
    # Nodes that only the Jacobi pool proposed (a hybrid tree): what the window's rows bought.
    pooled: frozenset[int] = frozenset()
    # Nodes copied from the request's own references (a client's predicted output): their
    # accepted count is what the prediction bought (usage's accepted_prediction_tokens).
    referenced: frozenset[int] = frozenset()
    # How good the retrieval was, before any forward: the longest suffix of the request's tokens
    # (at most MATCH_CAP) that the drafter found earlier with a token after it; 0: not measured.
    # A long match is a copy in progress (a code edit, a repeated answer); one token is a guess.
    match: int = 0
    depths: tuple[int, ...] = field(init=False)  # root children have depth 1
    # node (None: the root) -> {token: child}: `children`, built on first use for a derived tree
    _children: dict[int | None, dict[int, int]] | None = field(init=False, default=None, repr=False, compare=False)
    _mask: Any = field(init=False, default=None, repr=False, compare=False)  # ancestor_mask, built on first use

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents must have the same length")
        scores = self.scores
        if scores and len(scores) != len(self.tokens):
            raise ValueError("scores must be empty or one per node")
        # (min and max skip a NaN; the sum does not: NaN is never equal to itself)
        if scores and (not 0.0 <= min(scores) <= max(scores) <= 1.0 or sum(scores) != sum(scores)):
            raise ValueError("scores must be probabilities in [0, 1]")
        if self.match < 0:
            raise ValueError(f"match must be >= 0, got {self.match}")
        object.__setattr__(self, "match", min(MATCH_CAP, self.match))
        depths: list[int] = []
        children: dict[int | None, dict[int, int]] = {}
        for i, (tok, parent) in enumerate(zip(self.tokens, self.parents)):
            if parent is None:
                depths.append(1)
            elif 0 <= parent < i:
                depths.append(depths[parent] + 1)
            else:
                raise ValueError(f"node {i}: parent {parent} must precede it")
            slot = children.get(parent)
            if slot is None:
                children[parent] = {tok: i}
            elif tok in slot:
                raise ValueError(f"node {i}: duplicate sibling token {tok}")
            else:
                slot[tok] = i
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "_children", children)

    @property
    def children(self) -> dict[int | None, dict[int, int]]:
        """node (None: the root) -> {token: child}."""
        if self._children is None:
            children: dict[int | None, dict[int, int]] = {}
            for i, (tok, parent) in enumerate(zip(self.tokens, self.parents)):
                children.setdefault(parent, {})[tok] = i
            object.__setattr__(self, "_children", children)
        return self._children  # type: ignore[return-value]

    def child(self, node: int | None, token: int) -> int | None:
        """The child of `node` (None: the root) that carries `token`, if any."""
        kids = self.children.get(node)
        return kids.get(token) if kids else None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def mask(self) -> np.ndarray:
        """[n, n] bool ancestor-or-self mask: what each node may attend to within the tree."""
        if self._mask is None:
            object.__setattr__(self, "_mask", ancestor_mask(self.parents))
        return self._mask

    @classmethod
    def chain(cls, tokens: list[int] | tuple[int, ...]) -> DraftTree:
        """A single branch: each token the child of the previous one."""
        parents: list[int | None] = [None, *range(len(tokens) - 1)]
        return cls(tuple(tokens), tuple(parents[: len(tokens)]))

    def prefix(self, n: int) -> DraftTree:
        """The first `n` nodes: still a tree (parents precede children). Drafters emit nodes
        best first, so this is the best `n`-node draft."""
        if n >= len(self.tokens):
            return self
        return self._derived(
            tokens=self.tokens[:n],
            parents=self.parents[:n],
            scores=self.scores[:n],
            pooled=frozenset(i for i in self.pooled if i < n) if self.pooled else self.pooled,
            referenced=frozenset(i for i in self.referenced if i < n) if self.referenced else self.referenced,
            depths=self.depths[:n],
            _children=None,  # built if asked (the grammar's walk, a merge)
            _mask=None if self._mask is None else self._mask[:n, :n],
        )

    def judged(self, emitted: Sequence[int]) -> tuple[int, list[int]]:
        """What the step's `emitted` tokens (accepted drafts, then the model's own) say of this
        tree, whether or not all of it was verified: (k, hits), where nodes 0..k-1 are decided
        (on the emitted path: a hit; off it: a miss) and `hits` are those of them on the path.
        A node is undecided only below the path's last node when every emitted token matched:
        the model has not spoken that far. Ranks are node order, so k counts a prefix."""
        if not emitted:
            return 0, []
        hits: list[int] = []
        node: int | None = None
        for tok in emitted:
            node = self.child(node, tok)
            if node is None:
                break
            hits.append(node)
        if len(hits) < len(emitted):  # the path left the tree: every node is decided
            return len(self.tokens), hits
        # Descendants follow their parent, so the first undecided node is `last`'s first child.
        return min(self.children.get(hits[-1], {}).values(), default=len(self.tokens)), hits

    def with_pooled(self, nodes: Iterable[int]) -> DraftTree:
        """This tree with `nodes` marked as proposed by the pool alone."""
        return self._derived(pooled=frozenset(nodes))

    def with_referenced(self, nodes: Iterable[int]) -> DraftTree:
        """This tree with `nodes` marked as copied from the request's references."""
        return self._derived(referenced=frozenset(nodes))

    def with_match(self, match: int) -> DraftTree:
        """This tree with its retrieval's match length (`match`)."""
        if match < 0:
            raise ValueError(f"match must be >= 0, got {match}")
        return self._derived(match=min(MATCH_CAP, match))

    def _derived(self, **changes: Any) -> DraftTree:
        """A copy with `changes` to its fields, not validated again: the derivations above keep
        a valid tree valid, and a step makes a few per request (validating a large tree costs
        as much as the rest of its bookkeeping)."""
        tree = object.__new__(DraftTree)
        for name in DraftTree.__slots__:
            object.__setattr__(tree, name, changes[name] if name in changes else getattr(self, name))
        return tree


@dataclass(frozen=True, slots=True)
class WindowRows:
    """Rows a step computes for one request and never verifies: the Jacobi window.

    They follow the request's draft nodes in the packed batch and, like them, see the whole
    committed prefix and the root; among themselves they see what `mask` says.
    """

    tokens: tuple[int, ...]
    offsets: tuple[int, ...]  # RoPE position of each row, below the root's (root + offset)
    mask: np.ndarray  # [m, m] bool: the window rows each row may see (itself included)
    num_outputs: int  # the last `num_outputs` rows' next tokens go back to the drafter

    def __len__(self) -> int:
        return len(self.tokens)


@functools.lru_cache(maxsize=256)
def window_layout(levels: int, width: int) -> tuple[tuple[int, ...], np.ndarray]:
    """(offsets, mask) of a window of `levels` x `width` rows, level-major (row = i * width + j)."""
    i = np.repeat(np.arange(levels), width)  # [m] level of each row
    j = np.tile(np.arange(width), levels)  # [m] column of each row
    first = (i[None, :] == 0) & (j[None, :] <= j[:, None])  # level 0 up to the row's column
    down = (i[None, :] >= 1) & (i[None, :] <= i[:, None]) & (j[None, :] == j[:, None])  # its column, levels 1..i
    mask = first | down  # [m, m]
    mask.flags.writeable = False
    return tuple((1 + i + j).tolist()), mask


def window_rows(levels: Sequence[Sequence[int]]) -> WindowRows:
    """The rows of a window whose levels (oldest first) all have the same width."""
    width = len(levels[0])
    offsets, mask = window_layout(len(levels), width)
    return WindowRows(tuple(t for level in levels for t in level), offsets, mask, width)
