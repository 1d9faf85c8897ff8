"""A request's references (a client's predicted output): private single-branch drafts copied from them.

LLMA's "inference with reference" as an API (OpenAI's `prediction`): the client sends text
it expects the output to repeat, typically the file a code edit rewrites. Each reference
keeps a position: where the request's text stands in it. It starts at the reference's first
token (a prediction is of the output, from its start) and advances while accepted tokens
agree with the reference. When they do not, the reference is found again as LLMA does: the
longest suffix of the request's tokens that occurs in it, searched from where the last
agreement ended, so a document is read forward. What follows is proposed as one chain,
ahead of the drafter's own tree.

How long a chain is follows the request's own record: it doubles after a chain accepted
whole and drops to one token past what was accepted after a miss, so a wrong prediction
costs a token or so per step and leaves the budget to the drafter's other sources.

References are private: held per request id, never inserted into any shared trie or pool,
and dropped when the request finishes or is aborted. Pure Python and numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from batchserve.trees import DraftTree, TreeBuilder, merge_trees

# Before any evidence a chain may fill the whole budget: the client said this is the output.
UNBOUNDED = 1 << 30


@dataclass(slots=True)
class _Reference:
    tokens: np.ndarray  # [n] int32
    pos: int | None = 0  # the next token to copy, where the request's text agrees; None: lost
    last: int = 0  # where the last agreement ended: finding it again searches from here on


@dataclass(slots=True)
class _RequestReferences:
    refs: list[_Reference]
    copy_len: int = UNBOUNDED  # the longest chain to offer next
    offered: list[tuple[int, ...]] = field(default_factory=list)  # the chains the last proposal held


def _occurrence_ends(ref: np.ndarray, key: Sequence[int]) -> np.ndarray:
    """Positions right after each occurrence of `key` in `ref` that has a token after it."""
    m = len(key)
    starts = np.flatnonzero(ref[: len(ref) - m] == key[0])  # [k] candidate starts, each with a next token
    for i in range(1, m):
        starts = starts[ref[starts + i] == key[i]]
    return starts + m


class ReferenceDrafts:
    """The references of every running request that sent some, by request id."""

    def __init__(self, max_match: int = 4, min_match: int = 1) -> None:
        self.max_match = max_match
        self.min_match = min_match
        self._requests: dict[str, _RequestReferences] = {}

    def __len__(self) -> int:
        """Requests whose references are held (0 once every request has ended)."""
        return len(self._requests)

    def start(self, request_id: str, references: Sequence[Sequence[int]]) -> None:
        self._requests.pop(request_id, None)  # a restarted id starts clean
        refs = [_Reference(np.asarray(r, dtype=np.int32)) for r in references if len(r)]
        if refs:
            self._requests[request_id] = _RequestReferences(refs)

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def accepted(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Move each reference's position along the accepted tokens, and size the next chain."""
        state = self._requests.get(request_id)
        if state is None or not token_ids:
            return
        toks = np.asarray(token_ids, dtype=np.int32)
        for ref in state.refs:
            if ref.pos is not None:
                end = ref.pos + len(toks)
                if end <= len(ref.tokens) and np.array_equal(ref.tokens[ref.pos : end], toks):
                    ref.pos = ref.last = end
                else:
                    ref.pos = None
        if state.offered:
            best = max(state.offered, key=lambda c: _common_prefix(c, token_ids))
            hits = _common_prefix(best, token_ids)
            state.copy_len = 2 * len(best) if hits == len(best) else hits + 1
            state.offered = []

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        """Chains from the references (where the text agrees first, then by match length),
        merged by token path, at most `max_tokens` nodes, all marked referenced."""
        state = self._requests.get(request_id)
        if state is None or max_tokens < 1:
            return None
        length = min(max_tokens, state.copy_len)
        found: list[tuple[int, int, _Reference]] = []  # (-match length, order, reference)
        for order, ref in enumerate(state.refs):
            match = UNBOUNDED if ref.pos is not None else self._find(ref, token_ids)
            if match:
                found.append((-match, order, ref))
        builder = TreeBuilder(max_tokens)
        state.offered = []
        longest = 0  # the longest match among the references the tree drafts from
        for neg_match, _, ref in sorted(found, key=lambda f: f[:2]):
            chain = tuple(ref.tokens[ref.pos : ref.pos + length].tolist()) if ref.pos is not None else ()
            if not chain or (builder.full and (None, chain[0]) not in builder.index):
                continue
            longest = max(longest, -neg_match)
            state.offered.append(chain)
            parent: int | None = None
            for tok in chain:
                if builder.full and (parent, tok) not in builder.index:
                    break
                parent = builder.add(parent, tok, 1.0)
        tree = builder.tree()
        return None if tree is None else tree.with_referenced(range(len(tree))).with_match(longest)

    def ahead(
        self, request_id: str, token_ids: Sequence[int], max_tokens: int, own: DraftTree | None, single: bool = False
    ) -> DraftTree | None:
        """The references' chains first, then `own` (the drafter's tree) in what is left;
        `single`: one branch only, the references' if they have one."""
        if request_id not in self._requests:
            return own
        chains = self.propose(request_id, token_ids, max_tokens)
        if chains is None:
            return own
        if single:
            return chains.prefix(_first_branch(chains))
        return merge_trees(chains, own, max_tokens)

    def _find(self, ref: _Reference, token_ids: Sequence[int]) -> int:
        """Place `ref.pos` after the longest suffix of `token_ids` found in the reference (the
        first occurrence from `ref.last` on, else the last one); returns the match length, 0
        when nothing matches."""
        longest = min(self.max_match, len(token_ids), len(ref.tokens) - 1)
        for m in range(longest, self.min_match - 1, -1):
            ends = _occurrence_ends(ref.tokens, token_ids[-m:])
            if len(ends):
                after = ends[ends >= ref.last]
                ref.pos = int(after[0] if len(after) else ends[-1])
                return m
        return 0


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _first_branch(tree: DraftTree) -> int:
    """Nodes in the tree's first chain (nodes are added chain by chain, the best first)."""
    n = 1
    while n < len(tree) and tree.parents[n] == n - 1:
        n += 1
    return n
