"""DraftTree: the tokens a drafter proposes for one request in one step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def ancestor_mask(parents: Sequence[int | None]) -> np.ndarray:
    """[n, n] bool: row i is True at node i's ancestors (the root excluded) and at i itself.

    Nodes are in topological order; one vectorized pass per tree level, not one per node.
    """
    n = len(parents)
    mask = np.eye(n, dtype=bool)
    depth: list[int] = []
    for q in parents:  # parents precede children
        depth.append(0 if q is None else depth[q] + 1)
    if n:
        par = np.array([-1 if q is None else q for q in parents], dtype=np.int64)
        levels = np.array(depth)
        for d in range(1, max(depth) + 1):
            rows = np.flatnonzero(levels == d)
            mask[rows] |= mask[par[rows]]
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
    depths: tuple[int, ...] = field(init=False)  # root children have depth 1
    children: tuple[dict[int, int], ...] = field(init=False)  # per node (+1 for the root): token -> child
    # children[0] is the root's; children[i + 1] is node i's.
    _mask: Any = field(init=False, default=None, repr=False, compare=False)  # ancestor_mask, built on first use

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents must have the same length")
        if self.scores and len(self.scores) != len(self.tokens):
            raise ValueError("scores must be empty or one per node")
        if any(not 0.0 <= s <= 1.0 for s in self.scores):
            raise ValueError("scores must be probabilities in [0, 1]")
        depths: list[int] = []
        children: list[dict[int, int]] = [{} for _ in range(len(self.tokens) + 1)]
        for i, (tok, parent) in enumerate(zip(self.tokens, self.parents)):
            if parent is not None and not 0 <= parent < i:
                raise ValueError(f"node {i}: parent {parent} must precede it")
            slot = children[0 if parent is None else parent + 1]
            if tok in slot:
                raise ValueError(f"node {i}: duplicate sibling token {tok}")
            slot[tok] = i
            depths.append(1 if parent is None else depths[parent] + 1)
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "children", tuple(children))

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
        return DraftTree(self.tokens[:n], self.parents[:n], self.scores[:n])

    def ancestors(self, i: int) -> list[int]:
        """Node i's ancestors (excluding the root) and itself, from the top down."""
        path: list[int] = []
        node: int | None = i
        while node is not None:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
