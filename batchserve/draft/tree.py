"""DraftTree: the tokens a drafter proposes for one request in one step."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
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
    children: dict[int | None, dict[int, int]] = field(init=False)  # node (None: the root) -> {token: child}
    _mask: Any = field(init=False, default=None, repr=False, compare=False)  # ancestor_mask, built on first use

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents must have the same length")
        if self.scores and len(self.scores) != len(self.tokens):
            raise ValueError("scores must be empty or one per node")
        if any(not 0.0 <= s <= 1.0 for s in self.scores):
            raise ValueError("scores must be probabilities in [0, 1]")
        if self.match < 0:
            raise ValueError(f"match must be >= 0, got {self.match}")
        object.__setattr__(self, "match", min(MATCH_CAP, self.match))
        depths: list[int] = []
        children: dict[int | None, dict[int, int]] = {}
        for i, (tok, parent) in enumerate(zip(self.tokens, self.parents)):
            if parent is not None and not 0 <= parent < i:
                raise ValueError(f"node {i}: parent {parent} must precede it")
            slot = children.setdefault(parent, {})
            if tok in slot:
                raise ValueError(f"node {i}: duplicate sibling token {tok}")
            slot[tok] = i
            depths.append(1 if parent is None else depths[parent] + 1)
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "children", children)

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
        tokens, parents = self.tokens[:n], self.parents[:n]
        children: dict[int | None, dict[int, int]] = {}
        for i, (tok, parent) in enumerate(zip(tokens, parents)):
            children.setdefault(parent, {})[tok] = i
        return self._derived(
            tokens=tokens,
            parents=parents,
            scores=self.scores[:n],
            pooled=frozenset(i for i in self.pooled if i < n),
            referenced=frozenset(i for i in self.referenced if i < n),
            depths=self.depths[:n],
            children=children,
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


@dataclass(slots=True)
class TreeBuilder:
    """Accumulates a draft tree keyed by token path, so several matches merge into one tree."""

    budget: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int | None] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # path probability under the trie
    index: dict[tuple[int | None, int], int] = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.budget

    def add(self, parent: int | None, tok: int, prob: float) -> int:
        """Add (or find) the node; `prob` is its probability given its parent."""
        score = prob * (1.0 if parent is None else self.scores[parent])
        idx = self.index.get((parent, tok))
        if idx is None:
            idx = self.index[(parent, tok)] = len(self.tokens)
            self.tokens.append(tok)
            self.parents.append(parent)
            self.scores.append(score)
        else:  # reached again from a shorter match: keep the more confident estimate
            self.scores[idx] = max(self.scores[idx], score)
        return idx

    def tree(self) -> DraftTree | None:
        if not self.tokens:
            return None
        # A later match can raise a parent's score above its children's: keep children at or below.
        scores = list(self.scores)
        for i, parent in enumerate(self.parents):
            if parent is not None:
                scores[i] = min(scores[i], scores[parent])
        return DraftTree(tuple(self.tokens), tuple(self.parents), tuple(scores))


def walk(tree: DraftTree | None, choose: Callable[[int | None], int | None]) -> tuple[list[int], list[int]]:
    """Verify a draft: (emitted tokens, accepted node indices).

    From the root, take the model's token at the current node (`choose(node)`, None for the
    root); if a child carries it, move there and repeat, else stop. The last emitted token is
    the model's own. `choose` returning None ends the walk early (no further token known).
    """
    emitted: list[int] = []
    accepted: list[int] = []
    node: int | None = None
    while (tok := choose(node)) is not None:
        emitted.append(tok)
        node = tree.child(node, tok) if tree is not None else None
        if node is None:
            break
        accepted.append(node)
    return emitted, accepted


def merge_into(builder: TreeBuilder, tree: DraftTree | None) -> list[int | None]:
    """Add `tree`'s nodes to `builder` by token path, in order, while it has room; returns each
    node's index in the builder (None: it did not fit)."""
    index: list[int | None] = []
    if tree is None:
        return index
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents)):
        p = None if parent is None else index[parent]
        if (parent is not None and p is None) or (builder.full and (p, tok) not in builder.index):
            index.append(None)
            continue
        index.append(builder.add(p, tok, _relative_score(tree, i)))
    return index


def merge_trees(first: DraftTree | None, second: DraftTree | None, max_tokens: int) -> DraftTree | None:
    """`first`'s nodes, then `second`'s that are not already there (by token path), at most
    `max_tokens` in all. A node is pooled if only `second` had it; referenced if either tree's
    node on its path was."""
    if second is None or not len(second):
        return first
    builder = TreeBuilder(max_tokens)
    firsts = merge_into(builder, first)
    num_first = len(builder.tokens)
    seconds = merge_into(builder, second)
    merged = builder.tree()
    if merged is None:
        return None
    pooled = {i for i in seconds if i is not None and i >= num_first}
    merged = merged.with_pooled(pooled).with_referenced(_mapped(first, firsts) | _mapped(second, seconds))
    return merged.with_match(max(first.match if first is not None else 0, second.match))


def _mapped(tree: DraftTree | None, index: list[int | None]) -> set[int]:
    """The merged indices of `tree`'s referenced nodes that made it in."""
    if tree is None:
        return set()
    return {m for i in tree.referenced if (m := index[i]) is not None}


def _relative_score(tree: DraftTree, i: int) -> float:
    """Node i's score given its parent (what `TreeBuilder.add` takes); 1 without scores."""
    if not tree.scores:
        return 1.0
    parent = tree.parents[i]
    above = 1.0 if parent is None else tree.scores[parent]
    return min(1.0, tree.scores[i] / above) if above > 0 else 0.0
