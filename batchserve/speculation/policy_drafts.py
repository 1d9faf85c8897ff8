"""A step's drafts where the budget policy picks the lengths: whom a tree search is worth, the
shadow drafts, and each request's share of the step (`budget.py`), with speculation's host
time kept in proportion (`host_budget.py`).

Words used here: a *hopeful* request is one whose best possible tree could still pay for its rows
this step (its upper estimate beats the cost), so a search for it is worth its time; a *shadow
draft* is a tree proposed for a request the policy gives no rows, never verified, judged for free
against the tokens the request emits next (its estimates can rise again when its matches turn
good); shadows go to idle requests *in turn* (round robin), within the host's allowance."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from batchserve.config import DraftConfig
from batchserve.request import Request
from batchserve.speculation.budget import DraftBudgetPolicy, DraftCandidate, StepShape
from batchserve.speculation.host_budget import HostBudget
from batchserve.trees import DraftTree

logger = logging.getLogger("batchserve")
# A hopeful request's tree holds up to this many times the nodes it would get at best (and a shadow draft's more).
PROPOSAL_HEADROOM = 2

Propose = Callable[[Request, int], "DraftTree | None"]


@dataclass(slots=True)
class PolicyTrees:
    """One step's outcome: the trees verified, and every request's whole proposal (the policy
    verifies a prefix of it, or none; what the request then emits judges all of it)."""

    verified: dict[str, DraftTree] = field(default_factory=dict)
    proposals: dict[str, DraftTree] = field(default_factory=dict)


class PolicyDrafts:
    """Sizes the drafts of the requests whose length the policy chooses (module docstring)."""

    def __init__(self, policy: DraftBudgetPolicy, config: DraftConfig, host: HostBudget) -> None:
        self.policy = policy
        self.config = config
        self.host = host
        self._shadows_given = 0  # whose turn the next shadow draft is

    def trees(
        self, wanted_limits: list[tuple[Request, int]], shape: StepShape, baseline: bool, propose: Propose
    ) -> PolicyTrees:
        """Trees for (request, most draft tokens) this step of `shape`; `baseline`: the speed
        guard's step without drafts, which judges shadow drafts only. A step where planning
        pauses (`host_budget.py`) asks the policy nothing either."""
        host, num_seqs = self.host, shape.seqs
        planning = not baseline and host.may_plan(num_seqs)
        start = time.perf_counter()
        wanted = self._wanted(wanted_limits, shape) if planning else {}
        plan_seconds = time.perf_counter() - start
        idle = [req.request_id for req, _ in wanted_limits if req.request_id not in wanted]
        shadowed = self._shadowed(idle, num_seqs, shape.chunked)
        out = PolicyTrees()
        shared: list[tuple[Request, DraftTree]] = []  # the requests whose lengths the policy picks
        for req, limit in wanted_limits:
            # Never propose more than could be given, and a tree search only where a draft could
            # pay this step; else, in turn and within the host allowance, a shadow draft, which
            # the request's output judges for free (its estimates rise when matches turn good).
            n, shadow = wanted.get(req.request_id, 0), req.request_id in shadowed
            if not n and not shadow:
                continue
            t = time.perf_counter()
            tree = propose(req, max(n, min(limit, self.config.shadow_draft)))
            host.searched(time.perf_counter() - t, shadow=not n)
            if tree is None:
                continue
            out.proposals[req.request_id] = tree
            if n:
                shared.append((req, tree))
        lengths = self._allocate(shared, replace(shape, search_ms=0.0)) if shared else {}  # searches paid
        for req, tree in shared:
            k = lengths.get(req.request_id, 0)
            if k > 0:
                out.verified[req.request_id] = tree.prefix(k)
        if planning:
            host.planned(num_seqs, bool(out.verified), plan_seconds, shape.chunked)
        return out

    def _wanted(self, limits: list[tuple[Request, int]], shape: StepShape) -> dict[str, int]:
        """Nodes to search for, by request: the hopeful ones (`_proposal`)."""
        uppers = self.policy.upper_gains_many([(req.request_id, limit) for req, limit in limits])
        pending = [(req, limit, upper) for (req, limit), upper in zip(limits, uppers)]
        hopeful = self._hopeful(pending, shape)
        wanted = {req.request_id: self._proposal(len(up), hopeful.get(req.request_id, 0)) for req, _, up in pending}
        return {rid: n for rid, n in wanted.items() if n > 0}

    def _shadowed(self, idle: list[str], num_seqs: int, chunked: bool) -> set[str]:
        """The requests given a shadow draft this step: up to `shadow_requests` in turn, where
        drafts are dormant as many as the host allowance pays for."""
        if not idle:
            return set()
        n = self.host.shadows(min(len(idle), self.config.shadow_requests), num_seqs, chunked)
        start = self._shadows_given % len(idle)
        self._shadows_given += n
        return set((idle + idle)[start : start + n])

    def _hopeful(self, pending: list[tuple[Request, int, list[float]]], shape: StepShape) -> dict[str, int]:
        """The policy requests worth a tree search this step, with the nodes each would get at
        best. A constrained request always is, to its limit: its grammar's forced tokens are
        drafts that the acceptance estimates know nothing of."""
        always = {req.request_id: limit for req, limit, _ in pending if req.grammar is not None}
        try:
            return self.policy.hopeful([(req.request_id, upper) for req, _, upper in pending], shape) | always
        except Exception:
            logger.exception("the draft budget failed; this step decodes without policy drafts")
            return {}

    def _proposal(self, most: int, best: int) -> int:
        """How many nodes to propose for a request that could be given `most` at all and `best` if
        every node were worth the most it could be (0: none this step). The real allocation can
        give one request more than its best case (when the others' real trees turn out worse),
        so the proposal has room past it; but a busy step gives a request one or two nodes of
        the dozens it could take, and searching for the rest costs (benchmarks/README.md)."""
        if best <= 0:
            return 0
        return min(most, PROPOSAL_HEADROOM * best + self.config.shadow_draft)

    def _allocate(self, shared: list[tuple[Request, DraftTree]], shape: StepShape) -> dict[str, int]:
        try:
            candidates = [DraftCandidate(req.request_id, len(tree), tree.scores, tree.match) for req, tree in shared]
            return self.policy.allocate_step(candidates, shape)
        except Exception:
            logger.exception("the draft budget failed; this step decodes without policy drafts")
            return {}
