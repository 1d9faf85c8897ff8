"""Continuous batching over a paged KV pool.

NOTE: the one invariant: for every request, `all_token_ids[:num_computed_tokens]` have K/V
in the request's blocks and everything after it is still to be computed. Each step a
request computes the next chunk of those tokens (a prompt chunk, or just its last token),
and, once the chunk reaches the end, a draft tree hanging off the last token (speculation
proposes it as data; `reserve` finds its slots); verification then commits the accepted
path's K/V and appends the accepted tokens plus one more.
There is no prefill or decode phase: a preempted request simply drops all its K/V
(`num_computed_tokens = 0`) and recomputes its prompt and output as one long chunk.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import replace

from batchserve.config import SchedulerConfig
from batchserve.grammar.steps import GrammarSteps
from batchserve.records import RunnerOutput, ScheduledRequest, SchedulerOutput, StepDrafts
from batchserve.request import FinishReason, Request, RequestStatus
from batchserve.scheduler.block_allocator import BlockAllocator
from batchserve.scheduler.book import RequestBook
from batchserve.scheduler.chunks import committed_chunk, with_drafts
from batchserve.scheduler.commit import StepCommit, TokenHook, commit_request
from batchserve.scheduler.fairness import (
    PromptSlack,
    background_tenants,
    background_victim,
    held_to_slack,
    victim_for_blocks,
)
from batchserve.scheduler.pacing import PromptPacing
from batchserve.scheduler.prefix_cache import PrefixCache
from batchserve.scheduler.seats import SeatShares

logger = logging.getLogger("batchserve")


def _by_arrival(req: Request) -> int:
    return req.arrival_seq


class Scheduler(RequestBook):
    """Admits, batches, preempts and finishes requests over the paged KV pool, one step at a time
    (its book of requests: `RequestBook`)."""

    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator,
        scope: str = "global",
        on_token: TokenHook | None = None,
        prefix_caching: bool = False,
        grammar: GrammarSteps | None = None,
    ) -> None:
        """`scope`: who may reuse whose cached prefix (DraftConfig.trie_scope: "global", "tenant" or
        "request"); `on_token`: detokenizes a token of a request with stop strings (True: stop);
        `grammar`: structured output's share of each step, which speculation's planner shares."""
        super().__init__(allocator)
        self.config = config
        self.on_token = on_token
        self.grammar = grammar if grammar is not None else GrammarSteps()
        self.num_preemptions = 0  # since start
        self.prefix = PrefixCache(allocator, scope, enabled=prefix_caching)
        self.slack = PromptSlack(config.tenant_slack, config.max_num_batched_tokens)
        self.pacing = PromptPacing(config.prompt_stall, config.max_num_batched_tokens)
        self._room: int | None = None  # this step's prompt tokens left beside its decodes (`PromptPacing`)
        self._seats = SeatShares(config.max_num_seqs, config.max_num_seqs)  # this step's, from schedule()

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """This step's committed tokens: running requests' chunks, admissions, background prompts;
        drafts come after, as data (`reserve`), within the budget left (`draft_budget`)."""
        self.grammar.reset()
        cfg, recent = self.config, self.slack.recent()
        background = background_tenants(self.requests.values(), cfg.max_num_batched_tokens, recent, cfg.max_num_seqs)
        others = sum(1 for r in self.running if r.tenant not in background)
        flooding = held_to_slack(background, self.requests.values(), cfg.max_num_seqs, others)
        self._seats = SeatShares.of(self.running, self.waiting, cfg.max_num_seqs, background)
        for victim in self._seats.victims(self.running):  # a tenant over its seats while others wait
            self._preempt(victim)
        scheduled: list[ScheduledRequest] = []
        decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        self._room = self.pacing.room(decodes)
        # Running requests first, oldest first; background tenants' prompt chunks wait for last.
        budget, held = self._schedule_running(scheduled, self.config.max_num_batched_tokens, background)
        # Then admit waiting requests while there are seats, tokens and blocks.
        budget = self._admit(scheduled, budget, [r for r in self.waiting if r.tenant not in background], background)
        # Background prompts: the rest of the step; a flood's, beside other tenants' work, only
        # what the slack allows.
        shared = any(self.requests[s.request_id].tenant not in background for s in scheduled)
        cap = self.slack.cap(shared, flooding)
        cap = budget if cap is None else min(budget, cap)
        joined = self._schedule_background(scheduled, cap, held, background)
        budget -= joined
        finished, self._finished_ids = tuple(self._finished_ids), []
        # Drafts last: committed tokens and admissions come before speculation.
        out = SchedulerOutput(requests=tuple(scheduled), finished_request_ids=finished, draft_budget=budget)
        tenants = {self.requests[s.request_id].tenant for s in scheduled if s.request_id in self.requests}
        self.slack.scheduled(out, tenants, shared and bool(flooding), joined if flooding else 0)
        prompt = sum(s.num_tokens for s in scheduled if s.num_tokens > 1)
        self.pacing.scheduled(out, sum(1 for s in scheduled if s.num_tokens == 1), prompt)
        return out

    def reserve(self, out: SchedulerOutput, drafts: StepDrafts) -> SchedulerOutput:
        """`out` with speculation's proposal hung off its requests, each with the KV slots for its
        rows (speculation is optional: short of blocks, a window goes first, then a tree), and
        the grammar's masks of the rows a constrained request samples. A request whose grammar
        failed is left out of the step and ends here."""
        items = []
        for item in out.requests:
            req = self.requests[item.request_id]
            rid = item.request_id
            item = with_drafts(item, req, drafts.trees.get(rid), drafts.windows.get(rid), self.allocator)
            if item.sample and req.grammar is not None:
                mask = self.grammar.row_masks(req, item.draft)
                if mask is None:
                    continue  # its grammar failed: it ends below
                item = replace(item, token_mask=mask)
            items.append(item)
        for rid, error in self.grammar.failed.items():  # left out of the step: it ends here
            self._failed += self.fail([rid], error, FinishReason.CONSTRAINT_FAILED)
        reserved = replace(out, requests=tuple(items))
        # The step is measured as the engine runs it: this object (`observe_step`).
        self.slack.rebind(out, reserved)
        self.pacing.rebind(out, reserved)
        return reserved

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A step's measured wall time: background tenants' share of the next ones follows it, and
        so do the prompt tokens a step beside decodes may take."""
        self.slack.observe(out, seconds)
        self.pacing.observe(out, seconds)

    def _schedule_running(
        self, scheduled: list[ScheduledRequest], budget: int, background: frozenset[str]
    ) -> tuple[int, list[Request]]:
        """Each running request's committed chunk, oldest first, preempting when blocks run out
        (a background tenant's youngest first, then the youngest): a readmitted request is never
        the next victim of the ones it preceded. Returns the budget left and the background
        prompts held back."""
        held: list[Request] = []
        taken: set[str] = set()
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted for an older request in this loop
            if req.tenant in background and req.num_tokens - req.num_computed_tokens > 1:
                held.append(req)
                continue
            if self._paced(req) == 0:
                continue  # its prompt waits: this step's decodes have their share of prompt work
            item = self._try_schedule(req, budget)
            while item is None:
                victim = victim_for_blocks(self.running, taken, background)
                self._preempt(victim)
                if victim is req:
                    break
                item = self._try_schedule(req, budget)
            if item is not None:
                scheduled.append(item)
                taken.add(req.request_id)
                budget -= item.num_tokens
        return budget, held

    def _admit(
        self, scheduled: list[ScheduledRequest], budget: int, candidates: list[Request], background: frozenset[str]
    ) -> int:
        """Admit `candidates` (waiting, in queue order) while there are tokens and blocks; out of
        seats, a background tenant's request still in its prompt gives its seat to a foreground
        one. One whose next block a running request is computing right now waits a step or so,
        then reuses it. Returns the budget left."""
        in_flight = {k for r in self.running for k in self.prefix.uncached_keys(r)} if candidates else set()
        taken = {s.request_id for s in scheduled}
        for req in candidates:
            if budget <= 0:
                break
            if not self._seats.may_take(req):
                continue  # its tenant holds its share of the seats while another waits for one
            if len(self.running) >= self.config.max_num_seqs:
                victim = background_victim(self.running, req, taken, background, in_prompt=True)
                if victim is None:
                    break
                self._preempt(victim)
            cached = self.prefix.reuse(req)
            if self._paced(req) == 0:
                self._drop_blocks(req)
                break  # FCFS: it is admitted when a step has room for its prompt
            if self.prefix.should_wait(req, in_flight):
                self._drop_blocks(req)
                continue  # it keeps its place in the queue
            item = self._try_schedule(req, budget)
            while item is None:  # a background tenant's blocks go before another tenant waits
                victim = background_victim(self.running, req, taken, background, in_prompt=False)
                if victim is None:
                    break
                self._preempt(victim)
                item = self._try_schedule(req, budget)
            if item is None:
                self._drop_blocks(req)  # a waiting request holds no blocks, cached ones included
                break  # FCFS: wait for blocks rather than let younger requests overtake
            self.prefix.count(req, cached)
            self.waiting.remove(req)
            if req.stats.queue_seconds is None:
                req.stats.queue_seconds = time.monotonic() - req.arrival_time
            req.status = RequestStatus.RUNNING
            self._seats.took(req)
            bisect.insort(self.running, req, key=_by_arrival)  # running stays in arrival order
            scheduled.append(item)
            taken.add(req.request_id)
            budget -= item.num_tokens
            in_flight.update(self.prefix.uncached_keys(req))
        return budget

    def _schedule_background(
        self, scheduled: list[ScheduledRequest], cap: int, held: list[Request], background: frozenset[str]
    ) -> int:
        """Background tenants' prompt chunks and admissions within `cap` tokens, the least left to
        compute first (a tenant's short prompts are not held behind its own floods), never
        preempting for them. Returns the tokens they took."""
        if cap <= 0 or not background:
            return 0
        # Held back, still running (an admission may have preempted some since), and waiting (those too).
        running = [r for r in held if r.status is RequestStatus.RUNNING]
        waiting = [r for r in self.waiting if r.tenant in background]
        left = cap
        for req in sorted(running + waiting, key=lambda r: r.num_tokens - r.num_computed_tokens):
            if left <= 0:
                break
            if req.status is RequestStatus.WAITING:
                left = self._admit(scheduled, left, [req], background)
            elif (item := self._try_schedule(req, left)) is not None:
                scheduled.append(item)
                left -= item.num_tokens
        return cap - left

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> StepCommit:
        """Commit a step's results: (request, appended tokens) for each request that emitted
        tokens or finished, and what each sampling request's drafts earned (for speculation)."""
        done = StepCommit()
        for item in out.requests:
            req = self.requests.get(item.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            try:
                commit_request(self, req, item, result, done)
            except Exception as e:  # a bug met by one request (a stop hook, the grammar) ends only it
                logger.exception("committing request %s failed", req.request_id)
                self.fail([req.request_id], f"{type(e).__name__}: {e}")
                done.events.append((req, []))
        return done

    # ---- helpers -------------------------------------------------------------------------

    def _paced(self, req: Request) -> int | None:
        """The prompt tokens `req` may compute this step beside decodes (None: no bound; a
        request at its last token is a decode, never bounded)."""
        if self._room is None or req.num_tokens - req.num_computed_tokens <= 1:
            return None
        return max(0, self._room)

    def _try_schedule(self, req: Request, budget: int) -> ScheduledRequest | None:
        """Plan `req`'s committed tokens for this step within `budget` (and the prompt tokens
        `PromptPacing` leaves beside decodes), or None if out of blocks."""
        num_pending = req.num_tokens - req.num_computed_tokens
        room = self._paced(req)
        chunk = min(num_pending, budget, num_pending if room is None else room)
        if not self.allocator.grow(req.block_ids, req.num_computed_tokens + chunk):
            return None
        if room is not None:
            self._room = room - chunk
        return committed_chunk(req, chunk, sample=chunk == num_pending)

    def trim_blocks(self, req: Request) -> None:
        """Release blocks that held only rejected draft K/V."""
        self.allocator.shrink(req.block_ids, req.num_computed_tokens)

    def _preempt(self, req: Request) -> None:
        """Drop all of `req`'s K/V; it recomputes prompt and output when readmitted (from its
        cached blocks, if they are still cached then)."""
        self.running.remove(req)
        self._seats.gave_up(req)
        self._drop_blocks(req)
        req.status = RequestStatus.WAITING
        req.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _drop_blocks(self, req: Request) -> None:
        """Release all of `req`'s blocks (cached ones stay cached, for whoever comes next)."""
        self.allocator.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0
