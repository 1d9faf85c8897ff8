"""The two records that cross the scheduler/runner boundary each step."""

from __future__ import annotations

from dataclasses import dataclass

from batchserve.draft.tree import DraftTree
from batchserve.request import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    token_ids: tuple[int, ...]  # committed tokens whose K/V this step computes (prompt chunk, or the last token)
    num_computed_tokens: int  # K/V slots already filled before this step
    block_ids: tuple[int, ...]  # block table covering num_computed + len(token_ids) + len(draft) slots
    draft: DraftTree | None  # draft tree rooted at token_ids[-1]; only when `sample` is set
    sample: bool  # token_ids reach the end of the known tokens: emit the next token(s)
    params: SamplingParams  # how to sample / verify

    @property
    def num_tokens(self) -> int:
        """Rows this request adds to the step's packed batch."""
        return len(self.token_ids) + (len(self.draft) if self.draft is not None else 0)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the runner needs for one forward."""

    requests: tuple[ScheduledRequest, ...]  # in packing order
    finished_request_ids: tuple[str, ...]  # ended since the last step: drop their runner state

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """What one forward produced, per request that had `sample` set."""

    emitted: dict[str, list[int]]  # accepted draft tokens followed by the model's own next token
    num_accepted: dict[str, int]  # how many leading tokens of `emitted` came from the draft
