"""One request's share of a step, committed: the tokens it emitted up to a stop, the grammar's
advance, its speculation stats and what its drafts earned (as data, for speculation), then its
finish or the trim of blocks that held rejected drafts."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from batchserve.grammar.steps import GrammarSteps
from batchserve.records import CommittedDraft, RunnerOutput, ScheduledRequest
from batchserve.request import FinishReason, Request
from batchserve.scheduler.chunks import gather
from batchserve.scheduler.prefix_cache import PrefixCache

# Called for each token appended to the output of a request with stop strings; True stops it.
TokenHook = Callable[[Request, int], bool]


@dataclass(slots=True)
class StepCommit:
    """A committed step: (request, appended tokens) for each request that emitted tokens or
    finished, and each sampling request's `CommittedDraft` (what speculation learns from)."""

    events: list[tuple[Request, list[int]]] = field(default_factory=list)
    drafts: list[CommittedDraft] = field(default_factory=list)


class Committing(Protocol):
    """What a commit touches of the scheduler."""

    on_token: TokenHook | None
    grammar: GrammarSteps
    prefix: PrefixCache

    def finish(self, req: Request, reason: FinishReason) -> None: ...
    def fail(self, request_ids: Iterable[str], error: str) -> list[Request]: ...
    def trim_blocks(self, req: Request) -> None: ...


def commit_request(
    sched: Committing, req: Request, item: ScheduledRequest, result: RunnerOutput, done: StepCommit
) -> None:
    """Apply one request's share of a step, adding its event and its drafts' record to `done`
    (nothing for a prompt chunk that emits nothing)."""
    req.num_computed_tokens += len(item.token_ids)
    gather(req, item.request_id, result)
    emitted = result.emitted.get(item.request_id)
    if emitted is None:
        sched.prefix.register(req)
        return  # a prompt chunk that does not reach the end yet
    if not req.params.max_new_tokens:  # the prompt scored, nothing to generate
        sched.finish(req, FinishReason.LENGTH)
        done.events.append((req, []))
        return
    accepted = result.accepted[item.request_id]
    req.num_computed_tokens += len(accepted)
    appended: list[int] = []
    reason: FinishReason | None = None
    for tok in emitted:
        if req.grammar is not None:
            if tok == req.grammar.eos_token_id:  # the grammar's end: ends the text, not part of it
                reason = FinishReason.EOS
                break
            error = sched.grammar.advance(req, tok)
            if error is not None:  # the grammar refused what its own mask allowed
                sched.fail([req.request_id], error, FinishReason.CONSTRAINT_FAILED)
                done.events.append((req, appended))
                return
        req.output_token_ids.append(tok)
        req.all_token_ids.append(tok)
        appended.append(tok)
        reason = stop_reason(req, tok, sched.on_token)
        if reason is None and req.grammar is not None and req.grammar.done:
            # The text is complete: the grammar allows only the end of sequence. The rows
            # after this token chose among nothing; none of their tokens is taken.
            reason = FinishReason.EOS
        if reason is not None:
            break
    # emitted = the accepted drafts' tokens, then the model's own; a stop may cut it short.
    # Only drafts that reach the output count (stats, metrics, and what the policy learns).
    reached = accepted[: len(appended)]
    req.stats.steps += 1
    req.stats.draft_tokens_proposed += len(item.draft) if item.draft is not None else 0
    req.stats.draft_tokens_accepted += len(reached)
    if item.draft is not None and item.draft.referenced:
        req.stats.reference_drafts_accepted += sum(1 for node in reached if node in item.draft.referenced)
    done.drafts.append(CommittedDraft(item, reached, appended, result.window_outputs.get(item.request_id)))
    sched.prefix.register(req)
    if reason is not None:
        sched.finish(req, reason)
    else:
        sched.trim_blocks(req)
    done.events.append((req, appended))


def stop_reason(req: Request, tok: int, on_token: TokenHook | None) -> FinishReason | None:
    p = req.params
    if not p.ignore_eos and tok in req.eos_token_ids:
        return FinishReason.EOS
    if tok in p.stop_token_set:
        return FinishReason.STOP_SEQUENCE
    if p.stop and on_token is not None and on_token(req, tok):
        return FinishReason.STOP_SEQUENCE
    if len(req.output_token_ids) >= p.max_new_tokens or req.num_tokens >= req.max_total_len:
        return FinishReason.LENGTH
    return None
