"""A counted n-gram trie: how often each run of tokens occurred, with decay-and-prune."""

from __future__ import annotations

from collections.abc import Sequence


class TrieNode:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, TrieNode] = {}
        self.count = 0.0


class Trie:
    """A counted n-gram trie with a node budget."""

    def __init__(self) -> None:
        self.root = TrieNode()
        self.num_nodes = 0
        self.epoch = 0  # prunes so far: a node held outside the trie may be gone since

    def insert_sequence(
        self, tokens: Sequence[int], branch_length: int, first: int = 0, last: int | None = None
    ) -> None:
        """Count every run of up to `branch_length` consecutive tokens of `tokens` that starts
        at a position in [first, last) (the whole sequence by default; slices add up to it)."""
        for start in range(first, len(tokens) if last is None else min(last, len(tokens))):
            node = self.root
            for tok in tokens[start : start + branch_length]:
                node = self._child(node, tok)
                node.count += 1

    def extend_runs(self, ends: list[TrieNode], tok: int) -> list[TrieNode]:
        """Count the runs that end at a new token `tok`: each run of `ends` (the nodes of the
        runs ending just before it, longest first) extended by it, then `tok` alone. Returns the
        new runs' nodes, longest first: one step per run, where walking each from the root
        would take as many steps as it is long."""
        runs = []
        for node in (*ends, self.root):
            child = self._child(node, tok)
            child.count += 1
            runs.append(child)
        return runs

    def path(self, tokens: Sequence[int]) -> TrieNode:
        """The node of `tokens`, made (uncounted) where pruning removed it."""
        node = self.root
        for tok in tokens:
            node = self._child(node, tok)
        return node

    def find(self, key: Sequence[int]) -> TrieNode | None:
        node: TrieNode | None = self.root
        for tok in key:
            node = node.children.get(tok)  # type: ignore[union-attr]
            if node is None:
                return None
        return node

    def suffix_match(self, key: Sequence[int], limit: int) -> int:
        """The longest suffix of `key` (at most `limit` tokens) that is a path with children:
        a run seen before, with what followed it."""
        best = 0
        for m in range(1, min(limit, len(key)) + 1):
            node = self.find(key[len(key) - m :])
            if node is None or not node.children:
                break
            best = m
        return best

    def prune(self) -> None:
        """Halve every count and delete the nodes that fall below 1 (with their subtrees)."""
        self.epoch += 1
        removed = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for tok, child in list(node.children.items()):
                child.count /= 2
                if child.count < 1:
                    del node.children[tok]
                    removed += _subtree_size(child)
                else:
                    stack.append(child)
        self.num_nodes -= removed

    def _child(self, node: TrieNode, tok: int) -> TrieNode:
        child = node.children.get(tok)
        if child is None:
            child = node.children[tok] = TrieNode()
            self.num_nodes += 1
        return child


def _subtree_size(node: TrieNode) -> int:
    size, stack = 0, [node]
    while stack:
        n = stack.pop()
        size += 1
        stack.extend(n.children.values())
    return size
