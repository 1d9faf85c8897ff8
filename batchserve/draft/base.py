"""The drafter interface: what the scheduler asks of any draft source."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from batchserve.trees import DraftTree

if TYPE_CHECKING:
    from batchserve.trees import WindowRows


class Drafter(Protocol):
    """Proposes a draft tree per request per step and learns from accepted tokens.

    All calls come from the engine's loop thread, between model steps.
    """

    def on_request_start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        layout: str | None = None,
        scope: str | None = "",
        window: tuple[int | None, int | None, int | None] | None = None,
        references: Sequence[Sequence[int]] = (),
    ) -> None:
        """A request arrived (its prompt may be indexed); `layout` is its draft-shape override;
        `scope` names the n-grams it may share with other requests (None: its own only);
        `window` its Jacobi (W, N, G), for drafters that have one (None: the engine's);
        `references` the token ids of texts its output is expected to repeat (a client's
        predicted output): the request's alone, never shared, forgotten when it finishes."""

    def on_tokens_accepted(self, request_id: str, token_ids: Sequence[int]) -> None:
        """New output tokens were committed for the request."""

    def on_request_finish(self, request_id: str) -> None:
        """The request finished or was aborted: forget what belongs only to it."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        """A tree of at most `max_tokens` nodes continuing `token_ids`, or None."""


@runtime_checkable
class WindowDrafter(Protocol):
    """A drafter that also asks for rows computed but never verified (the Jacobi window)."""

    def window(self, request_id: str, max_rows: int) -> WindowRows | None:
        """This step's window rows for the request, or None if they do not fit `max_rows`."""

    def on_window_outputs(self, request_id: str, rows: WindowRows, outputs: Sequence[int]) -> None:
        """The model's next token after each of the window's last `rows.num_outputs` rows."""


@runtime_checkable
class Resumes(Protocol):
    """A drafter that tells a resumed request's earlier output (`resume_token_ids`, which any
    client can send) from output it generated: the request drafts from it, no one else learns it."""

    def on_tokens_resumed(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The request's output so far, given with it (before any accepted token): its own text
        only, never taught to a scope's trie or recent outputs."""


@runtime_checkable
class LearnsLater(Protocol):
    """A drafter whose learning from accepted tokens can wait off the step's critical path: the
    engine asks it to defer, then calls `learn()` while the next forward runs."""

    def defer_learning(self) -> None:
        """From now on, what accepted tokens teach shared structures waits for `learn()`."""

    def learn(self) -> None:
        """Apply what was deferred."""


class NoDrafter:
    """Plain decoding: never proposes anything (references included: `draft=none` drafts nothing)."""

    def on_request_start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        layout: str | None = None,
        scope: str | None = "",
        window: tuple[int | None, int | None, int | None] | None = None,
        references: Sequence[Sequence[int]] = (),
    ) -> None:
        pass

    def on_tokens_accepted(self, request_id: str, token_ids: Sequence[int]) -> None:
        pass

    def on_request_finish(self, request_id: str) -> None:
        pass

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> DraftTree | None:
        return None
