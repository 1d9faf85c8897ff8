"""LLMA-style single-branch drafts copied from the request's own prompt and output."""

from __future__ import annotations

from collections.abc import Sequence

from batchserve.draft.base import NoDrafter
from batchserve.draft.reference import ReferenceDrafts
from batchserve.trees import DraftTree


class SingleBranchDrafter(NoDrafter):
    """Find the longest suffix of the request's tokens that occurred earlier in them and copy
    what followed its most recent earlier occurrence ("Inference with Reference"). A request
    that sent references (a predicted output) copies from them first, as the paper does.

    Stateless but for those references: otherwise everything it needs is the token list the
    scheduler passes in.
    """

    def __init__(self, max_match: int = 8, min_match: int = 1) -> None:
        self.max_match = max_match
        self.min_match = min_match
        self.references = ReferenceDrafts(max_match, min_match)

    def on_request_start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        layout: str | None = None,
        scope: str | None = "",
        window: tuple[int | None, int | None, int | None] | None = None,
        references: Sequence[Sequence[int]] = (),
    ) -> None:
        self.references.start(request_id, references)

    def on_tokens_accepted(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.references.accepted(request_id, token_ids)

    def on_request_finish(self, request_id: str) -> None:
        self.references.finish(request_id)

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        chain = self.references.ahead(request_id, token_ids, max_tokens, None, single=True)
        return chain if chain is not None else self._copy(token_ids, max_tokens)

    def _copy(self, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        n = len(token_ids)
        if max_tokens < 1 or n < 2:
            return None
        for match_len in range(min(self.max_match, n - 1), self.min_match - 1, -1):
            start = self._last_occurrence(token_ids, match_len)
            if start is not None:
                copy_from = start + match_len
                copied = list(token_ids[copy_from : copy_from + max_tokens])
                if copied:  # no scores: the match only reaches the policy through scored trees
                    return DraftTree.chain(copied).with_match(match_len)
        return None

    @staticmethod
    def _last_occurrence(token_ids: Sequence[int], match_len: int) -> int | None:
        """Start of the latest occurrence of the last `match_len` tokens, ending before the end."""
        n = len(token_ids)
        suffix = list(token_ids[n - match_len :])
        first = suffix[0]
        # Scan right to left so the most recent (most local) context wins.
        for start in range(n - match_len - 1, -1, -1):
            if token_ids[start] == first and list(token_ids[start : start + match_len]) == suffix:
                return start
        return None
