"""Structured output's share of a step: forced tokens drafted, trees pruned, row masks, commits.

Pure Python around each request's `grammar.RequestGrammar`. A grammar that fails is that
request's failure alone: it is recorded in `failed` and the scheduler ends the request.
"""

from __future__ import annotations

import time

import numpy as np

from batchserve.grammar.matcher import GrammarError
from batchserve.request import Request
from batchserve.trees import DraftTree, merge_trees


class GrammarSteps:
    """Per step: the masks of every constrained request's verified rows, failures, and the time spent."""

    def __init__(self) -> None:
        # The masks of the root's and every kept node's row, from pruning this step's proposal;
        # the verified tree is a prefix of it, so its masks are a prefix too.
        self.masks: dict[str, np.ndarray] = {}
        self.failed: dict[str, str] = {}  # request id -> why its grammar failed this step
        self.seconds = 0.0  # this step's time in grammar matchers (planning and committing)

    def reset(self) -> None:
        self.masks, self.failed, self.seconds = {}, {}, 0.0

    def propose(self, req: Request, tree: DraftTree | None, limit: int, forced: bool) -> DraftTree | None:
        """`tree` with the tokens the grammar forces next first (with `forced`; as sure things, no
        score, so the policy takes them first), then cut to the nodes the grammar allows."""
        t0 = time.perf_counter()
        try:
            ahead = req.grammar.forced()[:limit] if forced else []
            if ahead:
                tree = merge_trees(DraftTree.chain(ahead), tree, limit)
            tree, self.masks[req.request_id] = req.grammar.prune(tree)
            return tree
        except GrammarError as e:
            self.failed[req.request_id] = f"structured output failed: {e}"
            return None
        finally:
            self.seconds += time.perf_counter() - t0

    def row_masks(self, req: Request, tree: DraftTree | None) -> np.ndarray | None:
        """The token masks of a constrained request's verified rows: the root's, then its tree's."""
        if req.request_id in self.failed:
            return None
        t0 = time.perf_counter()
        try:
            masks = self.masks.get(req.request_id)
            if masks is None:  # nothing was proposed for it this step: the root's row alone
                _, masks = req.grammar.prune(None)
            return masks[: 1 + (len(tree) if tree is not None else 0)]
        except GrammarError as e:
            self.failed[req.request_id] = f"structured output failed: {e}"
            return None
        finally:
            self.seconds += time.perf_counter() - t0

    def advance(self, req: Request, token: int) -> str | None:
        """Feed one emitted token to the request's grammar; why it failed, or None."""
        t0 = time.perf_counter()
        try:
            req.grammar.commit([token])
            return None
        except GrammarError as e:
            return f"structured output failed: {e}"
        finally:
            self.seconds += time.perf_counter() - t0
