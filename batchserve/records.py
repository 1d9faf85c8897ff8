"""The step's records: what the scheduler hands the runner (ScheduledRequest, SchedulerOutput),
what speculation proposes for a step (StepDrafts) and learns from it (CommittedDraft), what the
runner hands back (RunnerOutput) and the step's phase times (StepPhases). They live below the
scheduler, speculation, runner, engine and server, which all read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from batchserve.request import SamplingParams, TokenLogprob
from batchserve.trees import DraftTree, WindowRows, spec_mask


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
    window: WindowRows | None = None  # rows computed after the draft, never verified; only when `sample` is set
    # Structured output: the grammar's bitmask of allowed next tokens at the root's row and at each
    # draft node's row, [1 + len(draft), W] int32 (bit t % 32 of word t // 32). None: unconstrained.
    token_mask: np.ndarray | None = None
    # Penalties (`params.penalized`, when `sample` is set): the output so far, and the prompt where
    # a repetition penalty counts it too; empty otherwise.
    output_ids: tuple[int, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    # Prompt logprobs (`params.prompt_logprobs`): rows score_from.. of the chunk predict these prompt
    # tokens, whose logprobs the runner reports; empty when none are asked for or left.
    score_from: int = 0
    score_targets: tuple[int, ...] = ()
    # Output tokens the request holds before this step (a resumed request's first step starts its
    # seeded stream after them: its k-th token draws the k-th uniform, wherever it runs).
    num_output_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Rows this request adds to the step's packed batch."""
        return len(self.token_ids) + self.num_spec_rows

    @property
    def num_spec_rows(self) -> int:
        """Rows after the committed tokens: draft nodes, then window rows."""
        return (len(self.draft) if self.draft is not None else 0) + (len(self.window) if self.window is not None else 0)

    def spec_tokens(self) -> tuple[int, ...]:
        """Input tokens of the rows after the committed ones (draft nodes, then window rows)."""
        return (self.draft.tokens if self.draft is not None else ()) + (
            self.window.tokens if self.window is not None else ()
        )

    def spec_offsets(self) -> tuple[int, ...]:
        """Position of each row after the committed ones, below the root (a node's depth)."""
        return (self.draft.depths if self.draft is not None else ()) + (
            self.window.offsets if self.window is not None else ()
        )

    def spec_mask(self) -> np.ndarray | None:
        """[n, n] bool: which rows after the committed ones each of them sees (`tree.spec_mask`)."""
        tree = self.draft.mask if self.draft is not None else None
        return spec_mask(tree, self.window.mask if self.window is not None else None)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the runner needs for one forward."""

    requests: tuple[ScheduledRequest, ...]  # in packing order
    finished_request_ids: tuple[str, ...]  # ended since the last step: drop their runner state
    draft_budget: int = 0  # rows of the step's token budget the committed tokens left for drafts

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)


@dataclass(frozen=True, slots=True)
class StepDrafts:
    """Speculation's proposal for one step, as data: by request id, the draft tree it verifies
    and the Jacobi window rows computed after it. The scheduler reserves their KV slots and
    hangs them off its scheduled requests (`Scheduler.reserve`); short of blocks, it drops a
    window first, then a tree."""

    trees: dict[str, DraftTree] = field(default_factory=dict)
    windows: dict[str, WindowRows] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CommittedDraft:
    """One request's share of a committed step, for speculation to learn from: `accepted`, the
    draft nodes on the path that reached the output; `emitted`, the tokens the request took (a
    stop may cut them short); `window_outputs`, its window rows' tokens (None without a window)."""

    item: ScheduledRequest
    accepted: list[int]
    emitted: list[int]
    window_outputs: list[int] | None


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """What one forward produced, per request that had `sample` set."""

    emitted: dict[str, list[int]]  # accepted draft tokens followed by the model's own next token
    accepted: dict[str, list[int]]  # draft node indices on the accepted path, root first (one per emitted draft token)
    # Per request with a window: the model's next token after each of its output rows.
    window_outputs: dict[str, list[int]] = field(default_factory=dict)
    # Per request asking for logprobs: one entry per emitted token (`request.TokenLogprob`).
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Per request with `score_targets`: one entry per target, in order.
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    phases: StepPhases = field(default_factory=lambda: StepPhases())  # the runner's share: prepare, forward, verify

    @classmethod
    def merge(cls, results: list[RunnerOutput]) -> RunnerOutput:
        """One output from the forwards of disjoint groups of a step."""
        merged = cls({}, {})
        for r in results:
            for name in ("emitted", "accepted", "window_outputs", "logprobs", "prompt_logprobs"):
                getattr(merged, name).update(getattr(r, name))
            for name, seconds in r.phases.items():
                setattr(merged.phases, name, getattr(merged.phases, name) + seconds)
            if r.phases.attention is not None:
                merged.phases.attention = (merged.phases.attention or 0.0) + r.phases.attention
        return merged


@dataclass(slots=True)
class StepPhases:
    """Seconds one engine step spent in each phase; `wall` is the whole step, end to end.

    schedule: batching, drafting and the draft budget; prepare: packing, slot mapping,
    attention metadata, host-to-device copies and the acceptance arrays; forward: the model, token
    choice and acceptance on the device, up to the step's one copy back; verify: grammar masks,
    the accepted paths and KV compaction; commit: appending tokens, detokenizing, stop checks and
    outputs. `attention` is part of forward, not a phase of its own.
    """

    NAMES: ClassVar[tuple[str, ...]] = ("schedule", "prepare", "forward", "verify", "commit")

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    verify: float = 0.0
    commit: float = 0.0
    wall: float = 0.0
    # Part of forward: host seconds inside the attention backend, where it runs synchronously
    # (the CPU path); None where kernels run asynchronously and only the whole forward is timed.
    attention: float | None = None
    # Part of schedule, verify and commit: seconds in grammar matchers and token masks (structured
    # output); 0 in a step without a constrained request.
    grammar: float = 0.0
    # After `wall`, off the critical path: the policy's judging of the step's drafts (and settling
    # the estimates the next plan reads) and building its outputs (detokenizing, logprobs), which
    # the pipelined loop does beside the next forward.
    outputs: float = 0.0
    # Not a time: the tokens the step's requests emitted (what the phases bought).
    tokens: int = 0

    def items(self) -> list[tuple[str, float]]:
        return [(name, getattr(self, name)) for name in self.NAMES]
