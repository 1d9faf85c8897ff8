"""A scheduler with speculation beside it, stepped as `EngineCore` steps them, for tests that play
the model: schedule, propose, reserve; update, commit, forget the ended."""

from __future__ import annotations

from typing import Any

from batchserve.config import DraftConfig, SchedulerConfig
from batchserve.draft.base import Drafter
from batchserve.grammar.steps import GrammarSteps
from batchserve.records import RunnerOutput, SchedulerOutput
from batchserve.request import Request
from batchserve.scheduler import BlockAllocator, Scheduler
from batchserve.speculation import DraftBudgetPolicy, Speculation


class DraftingScheduler:
    """`Scheduler` + `Speculation` over one `GrammarSteps`; other attributes read the scheduler's."""

    def __init__(
        self,
        config: SchedulerConfig,
        draft_config: DraftConfig,
        allocator: BlockAllocator,
        drafter: Drafter,
        budget_policy: DraftBudgetPolicy | None = None,
        **scheduler: Any,
    ) -> None:
        grammar = GrammarSteps()
        self.scheduler = Scheduler(config, allocator, draft_config.trie_scope, grammar=grammar, **scheduler)
        self.speculation = Speculation(drafter, draft_config, budget_policy, grammar)

    def schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        return self.scheduler.reserve(out, self.speculation.propose(out, self.scheduler.requests))

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[tuple[Request, list[int]]]:
        done = self.scheduler.update(out, result)
        self.speculation.commit(done.drafts)
        self.speculation.forget_ended(self.scheduler.requests)
        return done.events

    def abort(self, request_id: str) -> bool:
        found = self.scheduler.abort(request_id)
        self.speculation.forget_ended(self.scheduler.requests)
        return found

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        self.scheduler.observe_step(out, seconds)
        self.speculation.observe_step(out, seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)
