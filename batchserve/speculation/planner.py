"""Speculation, one object the engine owns: each step's draft trees and windows, as data, and
what the committed step teaches.

Each step the engine calls `propose` (the scheduled step in, `StepDrafts` out: the scheduler
then reserves their slots), `commit` (what each request's drafts earned, as `CommittedDraft`s:
the policy's trackers, the drafter's trie and text, the windows' pool; requests that ended are
forgotten), `observe_step` (what the whole step cost), `judge` (with `judge_later`: the trackers
learn from committed proposals beside the next forward) and `learn` (the drafter's deferred
insertions). Nothing here calls back into the scheduler. Behind it: the drafter (`draft/`), the
budget policy (`budget.py`) with its trackers, fits, speed guard and host budget, Jacobi
windows (`windows.py`), and the judging of trees by later tokens (`judging.py`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Container, Iterable

from batchserve.config import DraftConfig
from batchserve.draft.base import Drafter, LearnsLater, Resumes, WindowDrafter
from batchserve.grammar.steps import GrammarSteps
from batchserve.records import CommittedDraft, ScheduledRequest, SchedulerOutput, StepDrafts
from batchserve.request import Request
from batchserve.speculation.budget import DraftBudgetPolicy, StepShape
from batchserve.speculation.host_budget import HostBudget
from batchserve.speculation.judging import OpenJudgements
from batchserve.speculation.policy_drafts import PolicyDrafts
from batchserve.speculation.windows import WindowStep, observe_window, plan_windows
from batchserve.trees import DraftTree, WindowRows

logger = logging.getLogger("batchserve")


class Speculation:
    """Proposes a tree per sampling request and decides how much of each the step verifies.

    Requests with their own `decoding_length` (and every request without a budget policy)
    get up to that many tokens, first come first served; the policy shares what is left
    among the others by expected gain. Speculation is optional: a failing drafter or policy
    costs drafts, never requests.
    """

    def __init__(
        self,
        drafter: Drafter,
        config: DraftConfig,
        policy: DraftBudgetPolicy | None,
        grammar: GrammarSteps | None = None,
    ) -> None:
        """`grammar`: structured output's share of the step, shared with the scheduler (it masks the
        rows and advances each request's grammar as it commits); the planner prunes drafts with it."""
        self.drafter = drafter
        self.windowed = isinstance(drafter, WindowDrafter)  # once: a Protocol isinstance is slow
        self.resumes = isinstance(drafter, Resumes)
        self.config = config
        self.policy = policy  # None: every request drafts `decoding_length` tokens
        # Requests the drafter has been told of, in the order it was: ended ones are forgotten in it
        # (a set's order would vary with string hashing, and the shared trie with it).
        self._started: dict[str, None] = {}
        # This step's whole proposal per policy request (the policy verifies a prefix of it, or
        # none): what the request then emits judges all of it (`observe_acceptance`).
        self._proposals: dict[str, DraftTree] = {}
        # Committed, not yet judged: (item, accepted nodes, emitted tokens, its whole proposal).
        # With `judge_later` they wait for `judge` (the engine's, after the step's outputs are
        # built); else each is judged as it is committed.
        self.judge_later = False
        self.judged_in_series = True  # later judging delays the next step (no forward beside it): charged
        self._to_judge: list[tuple[ScheduledRequest, list[int], list[int], DraftTree | None]] = []
        self._emitted = 0  # tokens this step's requests emitted (the speed guard's measure)
        self._plain = False  # this step is the speed guard's baseline: no policy drafts
        guard = policy.guard if policy is not None else None
        self.host = HostBudget(config.shadow_share, config.plan_backoff, guard)  # speculation's host time
        self.sizing = PolicyDrafts(policy, config, self.host) if policy is not None else None
        self._chunked = False  # this step carries a prompt chunk (the guard judges those apart)
        self.grammar = grammar if grammar is not None else GrammarSteps()
        self.judgements = OpenJudgements()  # trees whose deeper nodes later tokens will decide

    def start(self, req: Request) -> None:
        """Tell the drafter of a request (it indexes the prompt), once, when it first runs."""
        if req.request_id in self._started:
            return  # readmitted after a preemption: its index stands
        self._started[req.request_id] = None
        if self.policy is not None:  # its draft lengths start from its scope's experience, no one else's
            self.policy.tracker.begin(req.request_id, self._scope(req))
            self.policy.windows.begin(req.request_id, self._scope(req))
        try:
            self.drafter.on_request_start(
                req.request_id,
                req.prompt_token_ids,
                req.params.draft_layout,
                self._scope(req),
                req.params.jacobi,
                references=req.reference_token_ids,
            )
            if req.output_token_ids:  # resumed: its output so far is its own text, never its scope's
                self._resumed(req.request_id, list(req.output_token_ids))
        except Exception:  # speculation is optional: the request runs without drafts of its own
            logger.exception("the drafter failed to start request %s", req.request_id)

    def _resumed(self, request_id: str, tokens: list[int]) -> None:
        """A client sent these tokens as the request's output so far: a drafter with shared state
        (`Resumes`) keeps them to the request, as no one else's drafts may hold what a client
        says; the others hold nothing shared, and take them as accepted output."""
        if self.resumes:
            self.drafter.on_tokens_resumed(request_id, tokens)  # type: ignore[attr-defined]
        else:
            self.drafter.on_tokens_accepted(request_id, tokens)

    def finish(self, request_id: str) -> None:
        """The request ended: the policy's estimates and the drafter forget it."""
        if self.policy is not None:
            self.policy.tracker.forget(request_id)
            self.policy.windows.forget(request_id)
        if request_id not in self._started:
            return
        del self._started[request_id]
        self._proposals.pop(request_id, None)
        self.judgements.forget(request_id)
        try:
            self.drafter.on_request_finish(request_id)
        except Exception:  # the request is finished and its blocks are free whatever the drafter does
            logger.exception("the drafter failed to forget request %s", request_id)

    def _scope(self, req: Request) -> str | None:
        """Whose output n-grams `req` drafts from and adds to; None: its own text only. A request
        without speculation shares nothing: its text never becomes anyone's draft."""
        if req.params.decoding_length == 0:
            return None
        return {"global": "", "tenant": req.tenant}.get(self.config.trie_scope)

    def propose(self, out: SchedulerOutput, requests: dict[str, Request]) -> StepDrafts:
        """This step's trees and windows for the scheduled requests of `out`, within its draft
        budget (the scheduler reserves their slots, or drops them). The drafter hears of a
        request when it first runs."""
        items = list(out.requests)
        for item in items:
            self.start(requests[item.request_id])
        self._emitted = 0
        guard = self.policy.guard if self.policy is not None else None
        self._chunked = not _decode_only(items)
        self._plain = guard is not None and guard.wants_plain(len(items), self._chunked)
        self.host.new_step()
        start = time.perf_counter()
        trees, windows = self.plan(items, requests, out.draft_budget)
        self.host.clock(start)
        return StepDrafts(trees, windows)

    def plan(
        self, items: list[ScheduledRequest], requests: dict[str, Request], budget: int
    ) -> tuple[dict[str, DraftTree], dict[str, WindowRows]]:
        """Draft trees and window rows by request id, within `budget` tokens in all."""
        trees = self._trees(items, requests, budget)
        windows: dict[str, WindowRows] = {}
        if self.windowed:
            step = WindowStep(items, requests, trees, self.limit, self._plain, self._chunked)
            windows = plan_windows(self.drafter, self.policy, step, budget - sum(map(len, trees.values())))
        return trees, windows

    def _trees(self, items: list[ScheduledRequest], requests: dict[str, Request], budget: int) -> dict[str, DraftTree]:
        trees: dict[str, DraftTree] = {}
        self._proposals = {}
        by_policy: list[tuple[Request, int]] = []  # policy requests and their limits
        for item in items:
            if not item.sample:
                continue
            req = requests[item.request_id]
            limit = min(self.limit(req), budget)
            if self.policy is not None and req.params.decoding_length is None:
                if limit > 0:
                    by_policy.append((req, limit))
                continue
            tree = self._propose(req, limit)
            if tree is not None:
                trees[req.request_id] = tree
                budget -= len(tree)
        if not by_policy or self.sizing is None:
            return trees
        shape = self._step_shape(items, requests, sum(map(len, trees.values())), budget)
        sized = self.sizing.trees(by_policy, shape, self._plain, self._propose)
        self._proposals = sized.proposals
        return trees | sized.verified

    def limit(self, req: Request) -> int:
        """The most draft tokens `req` may verify this step (its length, output and context left)."""
        length = req.params.decoding_length
        if length is None:
            length = self.config.decoding_length
        remaining_out = req.params.max_new_tokens - len(req.output_token_ids) - 1
        remaining_ctx = req.max_total_len - req.num_tokens
        return max(0, min(length, remaining_out, remaining_ctx))

    def _propose(self, req: Request, limit: int) -> DraftTree | None:
        if limit <= 0:
            return None
        try:
            tree = self.drafter.propose(req.request_id, req.all_token_ids, limit)
        except Exception:  # a drafter bug costs the draft, not the request
            logger.exception("drafting for request %s failed; it decodes without a draft", req.request_id)
            return None
        if req.grammar is not None:  # the policy sizes what the grammar leaves
            # Forced tokens are drafts too: not under `draft none`, nor for window drafters, whose
            # trees mark the pool's nodes (a merge would move those marks).
            forced = self.config.method != "none" and not self.windowed
            tree = self.grammar.propose(req, tree, limit, forced)
        return tree if tree is not None and len(tree) else None

    def _step_shape(
        self, items: list[ScheduledRequest], requests: dict[str, Request], fixed_draft_tokens: int, budget: int
    ) -> StepShape:
        """What the policy weighs this step's drafts against (their budget: `budget` tokens)."""
        sampling = [requests[i.request_id] for i in items if i.sample]
        return StepShape(
            num_roots=len(sampling),
            num_other_tokens=sum(i.num_tokens for i in items) - len(sampling) + fixed_draft_tokens,
            context=sum(r.num_tokens for r in sampling) / len(sampling),
            num_seqs=len(items),
            token_budget=max(0, budget),
            chunked=self._chunked,
            search_ms=self.host.search_ms,
        )

    def commit(self, drafts: Iterable[CommittedDraft]) -> None:
        """A verified step's drafts, one `CommittedDraft` per sampling request. Speculation is
        optional: a bug here costs a request its drafts, never its tokens."""
        for d in drafts:
            try:
                self._observe_acceptance(d.item, d.accepted, d.emitted)
                self._accepted(d.item.request_id, d.emitted)
                if self.windowed:  # a WindowDrafter, checked once in __init__
                    observe_window(self.drafter, d.item, d.window_outputs)  # type: ignore[arg-type]
            except Exception:
                logger.exception("the drafter failed to learn request %s's tokens", d.item.request_id)

    def forget_ended(self, live: Container[str]) -> None:
        """Forget every request the drafter knows that is not in `live` (finished, failed, aborted)."""
        for rid in [r for r in self._started if r not in live]:
            self.finish(rid)

    def learn(self) -> None:
        """What the drafter learns from the last commit, after this step's proposals (AsyncEngine:
        while the forward runs). A failure costs drafts, never outputs."""
        if isinstance(self.drafter, LearnsLater):
            try:
                self.drafter.learn()
            except Exception:
                logger.exception("the drafter failed to learn from accepted tokens")

    def _observe_acceptance(self, item: ScheduledRequest, accepted: list[int], emitted: list[int]) -> None:
        """Count the step's emitted tokens (the speed guard's measure) and queue the judging of
        its proposal for `judge`: the policy's trackers learn which draft ranks (node indices)
        were on the accepted path, and the whole proposal is judged by the emitted tokens, the
        nodes not verified too, as far as they reach, and the rest of it by the next steps'
        tokens (`judging.py`): free evidence, the successes as well as the failures."""
        self._emitted += len(emitted)
        if self.policy is not None:  # the proposal now: the next attach replaces it
            proposal = self._proposals.pop(item.request_id, None) or item.draft
            self._to_judge.append((item, accepted, emitted, proposal))
            if not self.judge_later:
                self.judge()

    def judge(self) -> None:
        """Judge the proposals of the steps committed since the last call (the pipelined loop
        does it beside the next forward: the trackers then see a step's evidence one step later;
        what they estimate moves drafts, never tokens). Requests that ended since are skipped."""
        pending, self._to_judge = self._to_judge, []
        if not pending:
            return
        start = time.perf_counter()
        try:
            for item, accepted, emitted, proposal in pending:
                if item.request_id in self._started:
                    self._judge(item, accepted, emitted, proposal)
        except Exception:  # the policy's estimates: a bug there costs drafts, never outputs
            logger.exception("the draft policy failed to judge a step's drafts")
        if self.judge_later:  # after the step's wall
            self.host.clock_after(start, self.judged_in_series)
        else:
            self.host.clock(start)

    def settle(self, requests: dict[str, Request]) -> None:
        """After `judge`: the policy fits what it was taught and builds the estimates the next
        step's planning reads (beside the next forward when pipelined; the same numbers as
        building them when first read, as nothing else teaches the policy in between)."""
        if self.policy is None:
            return
        start = time.perf_counter()
        try:
            wanted = [
                (rid, self.limit(req))
                for rid, req in requests.items()
                if rid in self._started and req.params.decoding_length is None
            ]
            if not self.host.paused(len(wanted)):  # else no plan reads them next step: built when read
                self.policy.settle([(rid, limit) for rid, limit in wanted if limit > 0])
        except Exception:  # the policy's estimates: a bug there costs drafts, never outputs
            logger.exception("the draft policy failed to settle its estimates")
        self.host.clock_after(start, self.judged_in_series)

    def _judge(
        self, item: ScheduledRequest, accepted: list[int], emitted: list[int], proposal: DraftTree | None
    ) -> None:
        assert self.policy is not None
        if self.windowed:
            windows = self.policy.windows
            if item.window is None:
                windows.idle(item.request_id)
            else:
                pooled = item.draft.pooled if item.draft is not None else frozenset()
                windows.observe(item.request_id, sum(1 for node in accepted if node in pooled))
        tracker, rid = self.policy.tracker, item.request_id
        now, late = self.judgements.judge(rid, proposal, emitted)
        if now is None:
            tracker.skipped(rid)
        else:
            tracker.observe(rid, now.stop, now.hits, now.scores, now.match)
        for d in late:  # earlier steps' trees, judged further by these tokens
            tracker.observe_late(rid, d.start, d.stop, d.hits, d.scores, d.match)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Teach the policy what a whole step costs, beyond the forward alone (decode steps only:
        prompt-chunk rows need no logits and would skew the fit), and the speed guard how fast
        the step emitted tokens (every step; those with a prompt chunk apart)."""
        if self.policy is None or not out.requests:
            return
        decode_only = _decode_only(out.requests)
        if self.config.learn_step_costs and decode_only:
            context = sum(r.num_computed_tokens + len(r.token_ids) for r in out.requests) / len(out.requests)
            self.policy.observe_step(out.num_tokens, context, len(out.requests), seconds * 1e3)
        self.host.observe_step(seconds * 1e3)
        after_ms = self.host.take_after_ms()  # judging and settling after the last step, in series
        if self.policy.guard is not None:
            drafted = any(r.draft is not None or r.window is not None for r in out.requests)
            self.policy.guard.observe(
                len(out.requests), self._emitted, seconds * 1e3, drafted, not decode_only, self.host.spent_ms, after_ms
            )

    def _accepted(self, request_id: str, tokens: list[int]) -> None:
        """The drafter learns the request's new tokens (its trie, its text), on the step's clock."""
        start = time.perf_counter()
        self.drafter.on_tokens_accepted(request_id, tokens)
        self.host.clock(start)


def _decode_only(items: Iterable[ScheduledRequest]) -> bool:
    """Every request computes one committed token and samples: a step without prompt chunks."""
    return all(r.sample and len(r.token_ids) == 1 for r in items)
