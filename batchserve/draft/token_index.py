"""A request's own tokens as one array, read as the trie of all their n-grams when drafting."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Occurrences of a match key that drafting looks at, the most recent first: a key as common as
# a single space can occur thousands of times in a long prompt, and the newest say the most.
MAX_OCCURRENCES = 256
# Occurrences few enough to measure one by one: each costs a few array calls, where narrowing
# them all one token back per round costs a few array calls per token of match (32 for a copy).
_FEW = 4
# Occurrences few enough to group by their next token in Python (`IndexNode.children`): array
# operations cost tens of a Python loop's cost per occurrence a node (benchmarks/README.md).
_FEW_ENDS = 128


class TokenIndex:
    """A request's prompt and accepted output in one growable int32 array, read as the trie of
    all its runs of up to `branch_length` tokens (see `IndexNode`)."""

    __slots__ = ("_buf", "branch_length", "size")

    def __init__(self, tokens: Sequence[int], branch_length: int) -> None:
        self._buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int32)  # [capacity]
        self._buf[: len(tokens)] = tokens
        self.size = len(tokens)
        self.branch_length = branch_length

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self.size]  # [size] int32, a view

    def extend(self, token_ids: Sequence[int]) -> None:
        end = self.size + len(token_ids)
        if end > len(self._buf):
            grown = np.empty(max(end, 2 * len(self._buf)), dtype=np.int32)
            grown[: self.size] = self.tokens
            self._buf = grown
        self._buf[self.size : end] = token_ids
        self.size = end

    def suffix_match(self, key: Sequence[int], limit: int) -> int:
        """`suffix_match` over this index's tokens, at any depth (not only `branch_length`)."""
        return suffix_match(self.tokens, key, limit)

    def copy_source(self, key: Sequence[int], limit: int) -> tuple[int, np.ndarray]:
        """Where a request whose text ends with `key` would be copying from: (m, after) for the
        longest suffix of `key` (at most `limit`) that occurs here with a token after it, and
        where what followed each of its occurrences begins ([k] ascending, the most recent
        MAX_OCCURRENCES). m is 0 when nothing matches."""
        m, ends = _suffix_occurrences(self.tokens, key, limit)
        return m, ends[-MAX_OCCURRENCES:] + 1

    def continuation(self, after: np.ndarray, length: int) -> list[tuple[int, float]]:
        """What followed the most recent occurrence (`copy_source`), up to `length` tokens and
        `branch_length` deep, each with its share among the occurrences that agree so far (what
        the trie's counts would give it)."""
        if not len(after):
            return []
        toks = self.tokens
        copied = toks[after[-1] : after[-1] + min(length, self.branch_length)].tolist()
        chain: list[tuple[int, float]] = []
        for i, tok in enumerate(copied):
            if len(after) == 1:  # one occurrence left: it is the copy, every share 1
                return chain + [(t, 1.0) for t in copied[i:]]
            after = after[after < self.size]  # [k] occurrences with a next token
            agree = toks[after] == tok
            chain.append((tok, float(np.count_nonzero(agree)) / len(after)))
            after = after[agree] + 1
        return chain

    def find(self, key: Sequence[int]) -> IndexNode | None:
        """The node of `key`: where it occurs (its most recent MAX_OCCURRENCES occurrences)."""
        m, toks = len(key), self.tokens
        if not 0 < m <= min(self.size, self.branch_length):
            return None
        starts = np.flatnonzero(toks[: self.size - m + 1] == key[0])  # [k] candidate starts
        for i in range(1, m):
            starts = starts[toks[starts + i] == key[i]]
        if not len(starts):
            return None
        return IndexNode(self, starts[-MAX_OCCURRENCES:] + m, m)


def suffix_match(tokens: np.ndarray, key: Sequence[int], limit: int) -> int:
    """The longest suffix of `key` (at most `limit` tokens) that occurs in `tokens` [n] with a
    token after it: how much of what was just said has been said before, and what came next."""
    return _suffix_occurrences(tokens, key, limit)[0]


def _suffix_occurrences(tokens: np.ndarray, key: Sequence[int], limit: int) -> tuple[int, np.ndarray]:
    """(m, ends): `suffix_match`'s m and where each occurrence of that m-token suffix ends in
    `tokens` (its last token's place, ascending)."""
    limit = min(limit, len(key))
    none = np.empty(0, np.int64)
    if limit < 1 or len(tokens) < 2:
        return 0, none
    ends = np.flatnonzero(tokens[:-1] == key[-1])  # [k] where the last token occurs, a token after it
    m, found = 0, none
    while len(ends) and m < limit:  # the occurrences that extend one more token back
        if len(ends) <= _FEW:  # a long copy narrows to one or two early: finish each in one compare
            return _longest_of(tokens, key, limit, ends)
        m, found = m + 1, ends
        if m == limit:
            break
        ends = ends[ends >= m]
        ends = ends[tokens[ends - m] == key[-1 - m]]
    return m, found


def _longest_of(tokens: np.ndarray, key: Sequence[int], limit: int, ends: np.ndarray) -> tuple[int, np.ndarray]:
    """`_suffix_occurrences` over candidate `ends` (each already agreeing with key's last token):
    how far back each agrees, and the ends that agree the furthest."""
    back = np.asarray(key[-limit:][::-1])  # [<= limit] key's last tokens, the last first
    agree = []
    for end in ends.tolist():
        span = tokens[max(0, end - len(back) + 1) : end + 1][::-1]  # the text ending there, the last first
        same = span == back[: len(span)]
        agree.append(len(span) if same.all() else int(np.argmin(same)))
    m = max(agree)
    return m, ends[np.array(agree) == m]


class IndexNode:
    """A path of a `TokenIndex` seen as a trie node: `count` occurrences, `children` by next
    token. The counts are those of a trie of every run of up to `branch_length` tokens (for
    paths that occur at most MAX_OCCURRENCES times after their key), and children come in the
    order a trie would have created them (first occurrence first). Built lazily, per draft."""

    __slots__ = ("_children", "_depth", "_ends", "_index")

    def __init__(self, index: TokenIndex, ends: np.ndarray | list[int], depth: int) -> None:
        self._index = index
        # Ascending: the position after each occurrence. A list when few (a draft makes a node
        # for every child it looks at, most of them one or two occurrences deep in a copy).
        self._ends = ends
        self._depth = depth  # tokens in the path
        self._children: dict[int, IndexNode] | None = None

    @property
    def count(self) -> float:
        return float(len(self._ends))

    @property
    def children(self) -> dict[int, IndexNode]:
        if self._children is None:
            self._children = {} if self._depth >= self._index.branch_length else self._grouped()
        return self._children

    def _grouped(self) -> dict[int, IndexNode]:
        """The children: this node's occurrences that have a next token, grouped by it."""
        index, depth = self._index, self._depth + 1
        ends = self._ends
        if len(ends) <= _FEW_ENDS:  # a few: Python beats numpy's cost per call
            toks = index.tokens
            groups: dict[int, list[int]] = {}
            for end in ends if isinstance(ends, list) else ends.tolist():
                if end < index.size:
                    groups.setdefault(int(toks[end]), []).append(end + 1)
            return {tok: IndexNode(index, e, depth) for tok, e in groups.items()}
        ends = ends[ends < index.size]  # [k] occurrences with a next token
        if not len(ends):
            return {}
        toks = index.tokens[ends]  # [k] the token after each
        order = np.argsort(toks, kind="stable")  # [k] by token, each token's occurrences ascending
        bounds = np.flatnonzero(np.diff(toks[order])) + 1  # [n-1] where each token's run starts
        firsts = np.concatenate(([0], bounds))  # [n]
        runs = np.split(ends[order] + 1, bounds)  # n arrays, ascending
        tokens = toks[order[firsts]].tolist()
        by_first = np.argsort(order[firsts]).tolist()  # a trie creates children first occurrence first
        return {tokens[g]: IndexNode(index, runs[g], depth) for g in by_first}
