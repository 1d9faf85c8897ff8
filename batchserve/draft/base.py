"""The drafter interface: what the scheduler asks of any draft source."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from batchserve.draft.tree import DraftTree


class Drafter(Protocol):
    """Proposes a draft tree per request per step and learns from accepted tokens.

    All calls come from the engine's loop thread, between model steps.
    """

    def on_request_start(
        self, request_id: str, prompt_token_ids: Sequence[int], layout: str | None = None, scope: str | None = ""
    ) -> None:
        """A request arrived (its prompt may be indexed); `layout` is its draft-shape override;
        `scope` names the n-grams it may share with other requests (None: its own only)."""

    def on_tokens_accepted(self, request_id: str, token_ids: Sequence[int]) -> None:
        """New output tokens were committed for the request."""

    def on_request_finish(self, request_id: str) -> None:
        """The request finished or was aborted: forget what belongs only to it."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        """A tree of at most `max_tokens` nodes continuing `token_ids`, or None."""


class NoDrafter:
    """Plain decoding: never proposes anything."""

    def on_request_start(
        self, request_id: str, prompt_token_ids: Sequence[int], layout: str | None = None, scope: str | None = ""
    ) -> None:
        pass

    def on_tokens_accepted(self, request_id: str, token_ids: Sequence[int]) -> None:
        pass

    def on_request_finish(self, request_id: str) -> None:
        pass

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        return None
