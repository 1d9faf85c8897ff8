"""Where a request is copying from: its own text, or an output its scope finished recently.

The trie's copy chain (`trie.py`) drafts first what followed the longest earlier run of the text
a request ends with. Its own prompt and output are one source (`TokenIndex`). Recent outputs of
its scope are the other: a request that repeats an earlier answer (a retried call, an agent loop,
a question asked again) is copying that answer, at any depth, where the scope's output trie would
give it at most `branch_length` tokens of context and continuation together.

`RecentOutputs` keeps each scope's finished outputs (never a prompt) as one array, a separator
between two outputs so that no match or copy runs across them, and for each output the hash of
the prompt that produced it. A request whose prompt hashes the same as an earlier one of its scope
copies that output from its first token on, for as long as its own output agrees with it: the
strongest match there is (the whole text so far), where a suffix match would first have to grow.
Its tokens are bounded in all scopes together; the least recently used scope loses its oldest
outputs first. A request without a scope reads and adds nothing, as with the output tries.
Pure Python and numpy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from batchserve.draft.token_index import TokenIndex
from batchserve.draft.tree import MATCH_CAP

SEPARATOR = -1  # between two outputs: no token id equals it
# A copy chain drafts this many tokens per token of match (up to the index's depth). Below
# COPY_MIN_MATCH tokens a match is a guess that the counts make better (docs/design.md).
COPY_PER_MATCH = 2
COPY_MIN_MATCH = 3
Chain = list[tuple[int, float]]  # (token, share among the occurrences that agree so far)


@dataclass(slots=True)
class _ScopeText:
    text: TokenIndex
    trimmed: int = 0  # tokens dropped off the front: positions below count from the first ever kept
    starts: dict[int, int] = field(default_factory=dict)  # prompt hash -> where its latest output starts


@dataclass(frozen=True, slots=True)
class _Running:
    scope: str
    prompt_hash: int
    num_prompt: int
    repeat: int | None  # where the output of an earlier identical prompt starts, if kept


class RecentOutputs:
    """Each scope's latest finished outputs, at most `capacity` tokens in all scopes together."""

    def __init__(self, capacity: int, depth: int) -> None:
        self.capacity = capacity  # below 2 (an output and its separator): keep none
        self.depth = depth  # the longest continuation a copy drafts (`own_branch_length`)
        self._scopes: OrderedDict[str, _ScopeText] = OrderedDict()  # least recently used first
        self._running: dict[str, _Running] = {}
        self.num_tokens = 0  # in every scope's text, separators included

    def begin(self, request_id: str, scope: str | None, prompt: Sequence[int]) -> None:
        """A request of `scope` starts (None: it reads and adds nothing)."""
        if scope is None or self.capacity < 2:
            return
        key = hash(tuple(prompt))
        kept = self._scopes.get(scope)
        self._running[request_id] = _Running(scope, key, len(prompt), kept.starts.get(key) if kept else None)

    def end(self, request_id: str, output: Sequence[int]) -> None:
        """The request finished with this output: its scope keeps it, under its prompt's hash."""
        run = self._running.pop(request_id, None)
        if run is None or not len(output):
            return
        kept = self._scopes.get(run.scope)
        if kept is None:
            kept = self._scopes[run.scope] = _ScopeText(TokenIndex((), self.depth))
        self._scopes.move_to_end(run.scope)
        output = output[-(self.capacity - 1) :]  # one output never outgrows the bound
        kept.starts[run.prompt_hash] = kept.trimmed + kept.text.size
        kept.text.extend([*output, SEPARATOR])
        self.num_tokens += len(output) + 1
        while self.num_tokens > self.capacity:
            self._trim(next(iter(self._scopes)))

    def _trim(self, scope: str) -> None:
        """Drop the oldest half of `scope`'s outputs, or all of them."""
        kept = self._scopes[scope]
        tokens = kept.text.tokens
        ends = np.flatnonzero(tokens == SEPARATOR)  # [outputs] where each ends
        cut = int(ends[len(ends) // 2 - 1]) + 1 if len(ends) > 1 else kept.text.size
        self.num_tokens -= cut
        if cut >= kept.text.size:
            del self._scopes[scope]
            return
        kept.text = TokenIndex(tokens[cut:].tolist(), self.depth)
        kept.trimmed += cut
        kept.starts = {key: at for key, at in kept.starts.items() if at >= kept.trimmed}

    def drop(self, scope: str) -> None:
        """Forget a scope's outputs (its output trie went)."""
        kept = self._scopes.pop(scope, None)
        if kept is not None:
            self.num_tokens -= kept.text.size

    def copy(self, request_id: str, token_ids: Sequence[int], limit: int) -> tuple[int, Chain]:
        """(match, chain) for a running request whose text is `token_ids`: the earlier output of
        its very prompt while its output agrees with it (match MATCH_CAP: all of its text does),
        else `copy_chain` against its scope's recent outputs."""
        run = self._running.get(request_id)
        kept = self._scopes.get(run.scope) if run is not None else None
        if run is None or kept is None:
            return 0, []
        if run.repeat is not None:
            start, done = run.repeat - kept.trimmed, token_ids[run.num_prompt :]
            tokens = kept.text.tokens
            if start >= 0 and np.array_equal(tokens[start : start + len(done)], done):
                chain = tokens[start + len(done) : start + len(done) + self.depth].tolist()
                chain = chain[: chain.index(SEPARATOR)] if SEPARATOR in chain else chain
                if chain:
                    return MATCH_CAP, [(tok, 1.0) for tok in chain]
            # Diverged, trimmed away or ended: an output only grows, so it never copies it again
            # (and never compares its whole output again, step after step).
            self._running[request_id] = replace(run, repeat=None)
        return copy_chain(kept.text, token_ids, limit)


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
