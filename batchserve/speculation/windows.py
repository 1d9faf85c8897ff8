"""Jacobi windows in a step: which requests' windows run beside their trees, within the budget.

A window drafter (`draft/jacobi.py`) proposes rows of guessed tokens whose outputs become n-grams
for later drafts. Requests with a fixed decoding length get every window that fits; where the
budget policy decides, it admits the windows worth their rows (`DraftBudgetPolicy.admit_windows`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from batchserve.draft.base import Drafter, WindowDrafter
from batchserve.records import ScheduledRequest
from batchserve.request import Request
from batchserve.speculation.budget import DraftBudgetPolicy
from batchserve.trees import DraftTree, WindowRows

logger = logging.getLogger("batchserve")


@dataclass(frozen=True, slots=True)
class WindowStep:
    """What the windows of a step are planned against."""

    items: list[ScheduledRequest]  # the step's scheduled requests
    requests: dict[str, Request]  # every unfinished request by id
    trees: dict[str, DraftTree]  # this step's verified trees, by request id
    limit: Callable[[Request], int]  # the most draft tokens a request may verify this step
    plain: bool  # the speed guard's baseline step: no policy drafts
    chunked: bool  # the step carries a prompt chunk


def plan_windows(
    drafter: Drafter, policy: DraftBudgetPolicy | None, step: WindowStep, budget: int
) -> dict[str, WindowRows]:
    """Window rows for the sampling requests that speculate, within `budget` rows: all that
    fit for requests with a fixed length; where the policy decides, those worth their rows."""
    items, requests, trees = step.items, step.requests, step.trees
    assert isinstance(drafter, WindowDrafter)
    fixed: list[tuple[Request, WindowRows]] = []
    by_policy: list[tuple[Request, WindowRows]] = []
    for item in items:
        req = requests[item.request_id]
        if not item.sample or step.limit(req) <= 0:
            continue
        try:
            rows = drafter.window(req.request_id, budget)
        except Exception:  # a drafter bug costs the window, not the request
            logger.exception("the window of request %s failed; it runs without", req.request_id)
            continue
        if rows is not None and len(rows):
            (by_policy if policy is not None and req.params.decoding_length is None else fixed).append((req, rows))
    out: dict[str, WindowRows] = {}
    for req, rows in fixed:
        if len(rows) <= budget:
            out[req.request_id] = rows
            budget -= len(rows)
    if by_policy and budget > 0 and not step.plain:
        assert policy is not None
        sampling = [i for i in items if i.sample]
        spec = sum(map(len, trees.values())) + sum(map(len, out.values()))
        try:
            chosen = policy.admit_windows(
                [(req.request_id, len(rows)) for req, rows in by_policy],
                num_tokens=sum(i.num_tokens for i in items) + spec,
                num_decode_tokens=len(sampling) + spec,
                num_roots=len(sampling),
                expected_tokens=len(sampling) + (policy.planned_gain if trees else 0.0),
                context=sum(requests[i.request_id].num_tokens for i in sampling) / len(sampling),
                num_seqs=len(items),
                token_budget=budget,
                chunked=step.chunked,
            )
        except Exception:
            logger.exception("the window budget failed; this step runs no policy windows")
            chosen = []
        rows_of = {req.request_id: rows for req, rows in by_policy}
        out.update((rid, rows_of[rid]) for rid in chosen)
    return out


def observe_window(drafter: WindowDrafter, item: ScheduledRequest, outputs: list[int] | None) -> None:
    """Hand a window's output tokens back to a window drafter (its pool and next level)."""
    if item.window is None or outputs is None:
        return
    try:
        drafter.on_window_outputs(item.request_id, item.window, outputs)
    except Exception:  # a drafter bug costs the window's n-grams, not the request
        logger.exception("the window of request %s failed to update", item.request_id)
