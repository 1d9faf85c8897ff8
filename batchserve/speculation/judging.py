"""Judging draft trees over as many steps as their depth needs, so the acceptance estimates see
every outcome, not only the failures.

A step's emitted tokens decide a tree's nodes only as far as they reach. A shadow draft (proposed,
not verified) meets one emitted token: when that token leaves the tree, every node is decided, all
misses; when it matches, the nodes below stay undecided. Recording only what one step decides
would teach the deeper ranks from their failures alone, and a request whose matches turned good
(a repeated answer, a prediction that holds) would never earn the evidence to draft deeply. So an
undecided tree stays open and later steps' tokens judge the rest of it: a tree of depth d is
decided within d steps (each step emits at least one token).

Pure Python: trees and token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from batchserve.trees import DraftTree

# Open trees kept per request: one a step while its trees stay undecided, each decided within
# its depth in steps; past this many the oldest is dropped unjudged (a bound, not a policy).
MAX_OPEN = 16


@dataclass(slots=True)
class _Open:
    tree: DraftTree
    emitted: list[int]  # the tokens emitted since it was proposed
    decided: int  # its ranks [0, decided) are recorded


@dataclass(frozen=True, slots=True)
class Decided:
    """Ranks [start, stop) of one tree, newly decided; `hits` those of them on the emitted path."""

    start: int
    stop: int
    hits: tuple[int, ...]
    scores: tuple[float, ...]  # the drafter's scores of ranks [start, stop), if it gave them
    match: int = 0  # the tree's match length (`DraftTree.match`)


@dataclass(slots=True)
class OpenJudgements:
    """Per request, the trees proposed in earlier steps that are not yet wholly decided."""

    _open: dict[str, list[_Open]] = field(default_factory=dict)

    def judge(
        self, request_id: str, proposal: DraftTree | None, emitted: Sequence[int]
    ) -> tuple[Decided | None, list[Decided]]:
        """What this step's `emitted` tokens decide: (of this step's `proposal`, ranks from 0;
        None if none), and of the request's open trees, oldest first. A tree with nodes left
        undecided stays open."""
        late: list[Decided] = []
        still = self._open.pop(request_id, [])
        for item in still:
            item.emitted.extend(emitted)
            if (d := _advance(item)) is not None:
                late.append(d)
        now = None
        if proposal is not None and emitted:  # emitted: at least one node decided (k >= 1)
            fresh = _Open(proposal, list(emitted), 0)
            now = _advance(fresh)
            still.append(fresh)
        still = [item for item in still if item.decided < len(item.tree)]
        if still:
            self._open[request_id] = still[-MAX_OPEN:]
        return now, late

    def forget(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def num_open(self, request_id: str) -> int:
        return len(self._open.get(request_id, ()))


def _advance(item: _Open) -> Decided | None:
    """Judge an open tree by all the tokens emitted since it was proposed: its newly decided ranks."""
    k, hits = item.tree.judged(item.emitted)
    if k <= item.decided:
        return None
    start, item.decided = item.decided, k
    return Decided(start, k, tuple(h for h in hits if start <= h < k), item.tree.scores[start:k], item.tree.match)
