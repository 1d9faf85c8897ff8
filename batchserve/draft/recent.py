"""Where a request is copying from: its own text, or an output its scope finished recently.

The trie's copy chain (`trie.py`) drafts first what followed the longest earlier run of the text
a request ends with. Its own prompt and output are one source (`TokenIndex`). Recent outputs of
its scope are the other: a request that repeats an earlier answer (a retried call, an agent loop,
a cached question asked again) is copying that answer, at any depth, where the scope's output
trie would give it at most `branch_length` tokens of context and continuation together.

`RecentOutputs` keeps each scope's finished outputs (never a prompt) as one array, a separator
between two outputs so that no match or copy runs across them. Its tokens are bounded in all
scopes together; the least recently used scope loses its oldest outputs first. A request
without a scope reads and adds nothing, as with the output tries. Pure Python and numpy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from batchserve.draft.token_index import TokenIndex

SEPARATOR = -1  # between two outputs: no token id equals it
# A copy chain drafts this many tokens per token of match (up to the index's depth). Below
# COPY_MIN_MATCH tokens a match is a guess that the counts make better (docs/design.md).
COPY_PER_MATCH = 2
COPY_MIN_MATCH = 3
Chain = list[tuple[int, float]]  # (token, share among the occurrences that agree so far)


class RecentOutputs:
    """Each scope's latest finished outputs, at most `capacity` tokens in all scopes together."""

    def __init__(self, capacity: int, depth: int) -> None:
        self.capacity = capacity  # below 2 (an output and its separator): keep none
        self.depth = depth  # the longest continuation a copy drafts (`own_branch_length`)
        self._texts: OrderedDict[str, TokenIndex] = OrderedDict()  # least recently used first
        self.num_tokens = 0  # in every scope's text, separators included

    def add(self, scope: str, output: Sequence[int]) -> None:
        """A request of `scope` finished with this output."""
        if not len(output) or self.capacity < 2:
            return
        text = self._texts.get(scope)
        if text is None:
            text = self._texts[scope] = TokenIndex((), self.depth)
        self._texts.move_to_end(scope)
        before = text.size
        text.extend([*output[-self.capacity + 1 :], SEPARATOR])
        self.num_tokens += text.size - before
        while self.num_tokens > self.capacity:
            self._trim(next(iter(self._texts)))

    def _trim(self, scope: str) -> None:
        """Drop the oldest half of `scope`'s text (up to an output's start), or all of it."""
        text = self._texts[scope]
        tokens = text.tokens
        seps = np.flatnonzero(tokens == SEPARATOR)  # [outputs] where each ends
        keep_from = int(seps[len(seps) // 2 - 1]) + 1 if len(seps) > 1 else text.size
        self.num_tokens -= keep_from
        if keep_from >= text.size:
            del self._texts[scope]
            return
        self._texts[scope] = TokenIndex(tokens[keep_from:].tolist(), self.depth)

    def drop(self, scope: str) -> None:
        """Forget a scope's outputs (its output trie went)."""
        text = self._texts.pop(scope, None)
        if text is not None:
            self.num_tokens -= text.size

    def copy(self, scope: str, token_ids: Sequence[int], limit: int) -> tuple[int, Chain]:
        """`copy_chain` against the scope's recent outputs (no scope text: no match)."""
        text = self._texts.get(scope)
        return copy_chain(text, token_ids, limit) if text is not None else (0, [])


def copy_chain(index: TokenIndex, token_ids: Sequence[int], limit: int) -> tuple[int, Chain]:
    """(m, chain): the longest suffix of `token_ids` (at most `limit` tokens) that occurs in
    `index` with a token after it, and, where m >= COPY_MIN_MATCH, what followed its most recent
    occurrence (COPY_PER_MATCH tokens per token of match, up to the index's depth, never past a
    separator)."""
    m, after = index.copy_source(token_ids, limit)
    if m < COPY_MIN_MATCH:
        return m, []
    chain = index.continuation(after, COPY_PER_MATCH * m)
    for i, (tok, _) in enumerate(chain):
        if tok == SEPARATOR:
            return m, chain[:i]
    return m, chain
