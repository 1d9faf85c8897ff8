"""Building draft trees: `TreeBuilder` merges matches into one tree by token path, `merge_trees`
joins two drafters' trees, `walk` follows the model's choices down one (the tree itself:
`tree.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from batchserve.trees.tree import DraftTree


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
