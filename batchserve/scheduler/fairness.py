"""Tenants' shares of a step: one tenant's long prompts never stall another tenant's decoding.

Every request carries a tenant key (`Request.tenant`, the isolation key of the drafts and the
prefix cache; "" for clients without one). While two or more tenants hold requests, a tenant
whose prompt work still to compute (prompts, resumed tokens, recomputation after preemption)
is more than one step's token budget, and more than twice another tenant's, is *background*: it asks
for more than a step can give, so giving it first come, first served would hand it whole steps
while everyone else waits. Then:

- its prompt chunks run after every other tenant's decodes, prompt chunks and admissions;
- while the server is busy (other tenants run more than an eighth of the seats), or if it holds
  more than one request (`held_to_slack`): in a step that serves another tenant its chunks may
  lengthen that step by at most
  `SchedulerConfig.tenant_slack` of its time, and join only every other such step (the steps
  without them measure what "its time" is). `PromptSlack` sizes them from the measured step
  times, so the bound holds on any device, at any context length, without a cost model. Whether
  a tenant is held to the slack depends on the server's load, never on another tenant's presence
  alone: a lone long prompt beside another tenant's single tiny decode takes the rest of every
  step (the steps beside decodes are still paced, `pacing`);
- seats and KV blocks: out of either, the scheduler preempts a background tenant's youngest
  request before anyone else's.

In a step that serves no other tenant (everyone else idle) background work takes the whole
budget: the device never idles for fairness. One tenant alone, or tenants that each fit in a
step, see plain first come, first served: nothing here changes their steps. Pure Python.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from batchserve.records import SchedulerOutput
from batchserve.request import Request

# Exponential average weight of the newest step in the baseline step time.
_BASELINE_WEIGHT = 0.25
# Background chunks grow or shrink by at most this factor from one measured step to the next:
# one noisy step cannot swing the share, and a too-large chunk is halved at once.
_MAX_STEP_CHANGE = 2.0


def victim_for_blocks(running: Sequence[Request], taken: set[str], background: frozenset[str]) -> Request:
    """Who gives up its blocks when a running request needs more: the youngest request of a
    background tenant not in the step yet, else the youngest not in the step yet (`running` is
    in arrival order, and holds at least the one that needs them)."""
    free = [r for r in running if r.request_id not in taken]
    return next((r for r in reversed(free) if r.tenant in background), free[-1])


def background_victim(
    running: Sequence[Request], req: Request, taken: set[str], background: frozenset[str], in_prompt: bool
) -> Request | None:
    """For `req` of a foreground tenant, out of seats or blocks: a background tenant's youngest
    running request not in the step (`in_prompt`: one still in its prompt, which loses least)."""
    if req.tenant in background:
        return None
    for r in reversed(running):
        if r.tenant in background and r.request_id not in taken:
            if not in_prompt or r.num_tokens - r.num_computed_tokens > 1:
                return r
    return None


def prompt_backlog(requests: Iterable[Request]) -> Counter[str]:
    """Tokens each tenant still has to compute before its requests sample (decodes count 0)."""
    backlog: Counter[str] = Counter()
    for req in requests:
        pending = req.num_tokens - req.num_computed_tokens
        backlog[req.tenant] += pending if pending > 1 else 0
    return backlog


def background_tenants(
    requests: Iterable[Request], step_tokens: int, recent: Iterable[str] = (), seats: int | None = None
) -> frozenset[str]:
    """The tenants whose prompt backlog is more than a step's `step_tokens` and more than twice
    the lightest tenant's (one alone is nobody's background; tenants of comparable loads, two
    bursts of ordinary prompts, share first come, first served; a flood is background beside
    either). `recent`: tenants without requests now that count as present (nothing to compute).

    With `seats` (the batch size): a tenant whose requests fit its even share of the seats and
    whose prompts each fit a step is no flood, whatever its total: a few ordinary prompts beside
    a tenant that only decodes (a seat hog's backlog is 0) are not held to the slack."""
    requests = list(requests)
    backlog = prompt_backlog(requests)
    for tenant in recent:
        backlog[tenant] += 0
    if len(backlog) < 2:
        return frozenset()
    lightest = min(backlog.values())
    heavy = {t for t, tokens in backlog.items() if tokens > max(step_tokens, 2 * lightest)}
    if seats is None or not heavy:
        return frozenset(heavy)
    fair = max(1, seats // len(backlog))
    count: Counter[str] = Counter()
    longest: Counter[str] = Counter()
    for r in requests:
        if r.tenant in heavy:
            count[r.tenant] += 1
            longest[r.tenant] = max(longest[r.tenant], r.num_tokens - r.num_computed_tokens)
    return frozenset(t for t in heavy if count[t] > fair or longest[t] > step_tokens)


def held_to_slack(
    background: frozenset[str], requests: Iterable[Request], seats: int, others_running: int
) -> frozenset[str]:
    """The background tenants held to the slack (`PromptSlack`): all of them while the server is
    busy (other tenants run more than an eighth of the `seats`, at least 1), else those with more
    than one request (a burst of long prompts, a prompt's samples). So one long prompt beside
    another tenant's single decode on a mostly idle server takes the rest of every step, and
    several never do."""
    if not background:
        return frozenset()
    if others_running > max(1, seats // 8):
        return background
    count = Counter(r.tenant for r in requests if r.tenant in background)
    return frozenset(t for t in background if count[t] > 1)


@dataclass(slots=True)
class PromptSlack:
    """How many prompt tokens background tenants may take in a step that serves other tenants.

    Feedback on measured wall time, not a model: steps that serve other tenants without
    background chunks keep an average baseline; after a step with them, their size is scaled by
    how far the step overran `slack` times that baseline (at most halved or doubled per step),
    so such a step takes about (1 + slack) times the baseline whatever the device or context.
    They join every other such step at most, so the baseline stays fresh and the other tenants'
    time per token grows by about slack / 2 on average.

    A step is not preempted: one whole step of background work (a full budget of prompt at a
    long context: a second on a small CPU) would hold every request that arrives meanwhile. So a
    tenant served within the last `linger_s` still counts (its users think between requests and
    come back: `recent`), and a step that serves nobody else takes the same allowance, not the
    budget; only a longer pause leaves a background tenant alone, with whole steps.
    """

    slack: float
    budget: int  # tokens a step: the most the allowance grows to
    tokens: int = 1  # the allowance; grows from one token as steps show room for more
    baseline_ms: float | None = None
    linger_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    _seen: dict[str, float] = field(default_factory=dict)  # tenant -> when a step last served it
    _last: tuple[SchedulerOutput, int] | None = None  # the step scheduled last, its background tokens
    _joined: bool = False  # whether the last measured shared step carried background chunks

    def recent(self) -> set[str]:
        """The tenants a step served within the last `linger_s`."""
        now = self.clock()
        for tenant in [t for t, at in self._seen.items() if now - at >= self.linger_s]:
            del self._seen[tenant]
        return set(self._seen)

    def cap(self, shared: bool, background: frozenset[str]) -> int | None:
        """The background prompt tokens allowed in the step being scheduled (None: no bound):
        `shared`, it serves another tenant; else some tenant was served lately."""
        if not background:
            return None
        if shared:  # the first such step measures the baseline; then every other one
            return 0 if self.baseline_ms is None or self._joined else self.tokens
        return None if self.baseline_ms is None else self.tokens

    def scheduled(self, out: SchedulerOutput, tenants: Iterable[str], shared: bool, background_tokens: int) -> None:
        """The step just scheduled: the tenants it serves, whether it serves any beside background
        ones, and the background prompt tokens it carries (only shared steps are measured)."""
        now = self.clock()
        for tenant in tenants:
            self._seen[tenant] = now
        self._last = (out, background_tokens) if shared else None

    def rebind(self, scheduled: SchedulerOutput, runs: SchedulerOutput) -> None:
        """The step scheduled last runs as `runs` (its drafts hung off it): measured as that."""
        if self._last is not None and self._last[0] is scheduled:
            self._last = (runs, self._last[1])

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """The measured wall time of a step this scheduled (others are ignored)."""
        last, self._last = self._last, None
        if last is None or last[0] is not out:
            return
        ms, background = seconds * 1000.0, last[1]
        if background == 0:
            base = self.baseline_ms
            self.baseline_ms = ms if base is None else base + _BASELINE_WEIGHT * (ms - base)
            self._joined = False
            return
        self._joined = True
        base = self.baseline_ms or ms
        excess, room = ms - base, self.slack * base
        scale = _MAX_STEP_CHANGE if excess <= room / _MAX_STEP_CHANGE else max(1 / _MAX_STEP_CHANGE, room / excess)
        sized = round(background * scale)
        if excess <= room:  # room left: never below what was allowed (the chunk may have been short)
            sized = max(sized, self.tokens)
        self.tokens = max(1, min(self.budget, sized))
