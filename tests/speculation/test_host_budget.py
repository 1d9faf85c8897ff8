"""Speculation's host time: shadow drafts on an allowance, planning paused where drafts are
dormant, tree searches priced, and the speed guard's baseline without speculation."""

from __future__ import annotations

import time

import pytest

from batchserve.config import DraftConfig, SchedulerConfig
from batchserve.records import RunnerOutput
from batchserve.scheduler import BlockAllocator
from batchserve.speculation.budget import AcceptanceTracker, DraftBudgetPolicy, DraftCandidate, StepShape
from batchserve.speculation.host_budget import HostBudget
from batchserve.speculation.speed_guard import SpeedGuard
from tests.scheduler.drafting import DraftingScheduler
from tests.scheduler.test_scheduler import CountingDrafter, _req
from tests.speculation.workloads import cpu_like, gpu_like


def _dormant(budget: HostBudget, num_seqs: int) -> None:
    """Steps at this batch size whose plans drafted nothing, until drafts there are dormant."""
    while not budget.dormant(num_seqs):
        assert budget.may_plan(num_seqs)
        budget.planned(num_seqs, drafted=False, seconds=0.0)


def test_shadows_are_unlimited_until_measured_and_where_drafts_run():
    b = HostBudget(share=0.02, max_skip=4)
    assert b.shadows(4, num_seqs=4) == 4  # nothing measured yet
    b.observe_step(10.0)
    b.searched(0.0005, shadow=True)  # 0.5 ms a shadow search
    assert b.shadows(4, num_seqs=4) == 4  # drafts not dormant at this batch size
    _dormant(b, 4)
    # Dormant: 2% of a 10 ms step pays 0.4 searches a step: 2 in 5 steps, never a burst.
    given = [b.shadows(4, num_seqs=4) for _ in range(10)]
    assert sum(given) == 4 and max(given) == 1
    assert b.shadows(4, num_seqs=1) == 4  # another batch size is judged on its own
    b.planned(4, drafted=True, seconds=0.0)  # a plan drafted: no longer dormant
    assert not b.dormant(4) and b.shadows(4, num_seqs=4) == 4


def test_an_empty_plan_where_drafts_are_dormant_pauses_planning_until_paid_for():
    b = HostBudget(share=0.02, max_skip=16)
    b.observe_step(10.0)
    b.planned(8, drafted=False, seconds=0.001)  # not dormant yet: no pause
    assert b.may_plan(8)
    _dormant(b, 8)
    b.planned(8, drafted=False, seconds=0.0007)  # 0.7 ms at 0.2 ms a step: 3 whole steps
    assert [b.may_plan(8) for _ in range(5)] == [False, False, False, True, True]
    b.planned(8, drafted=False, seconds=1.0)  # a slow plan pauses at most max_skip steps
    assert [b.may_plan(8) for _ in range(17)].count(False) == 16
    b.planned(8, drafted=True, seconds=1.0)  # a plan that drafts pauses nothing
    assert b.may_plan(8) and not b.dormant(8)
    with pytest.raises(ValueError, match="host budget"):
        HostBudget(share=1.5)


def test_a_tree_search_is_priced_in_choosing_whom_to_search_for():
    """Rows for free (a 10 ms step flat past 64 tokens): without a price on the search, a request
    whose nodes are worth 0.05 tokens each is worth searching; at 1 ms a search it is not, and
    at 100 ms not even the sure one is."""
    policy = DraftBudgetPolicy(gpu_like(cdl=64), AcceptanceTracker(16))
    upper = [("sure", [0.95] * 16), ("weak", [0.05] * 16)]
    assert set(policy.hopeful(upper, StepShape(2))) == {"sure", "weak"}
    assert set(policy.hopeful(upper, StepShape(2, search_ms=1.0))) == {"sure"}
    assert policy.hopeful(upper, StepShape(2, search_ms=100.0)) == {}
    # Once searched, a tree's search is paid: the allocation prices rows alone.
    got = policy.allocate([DraftCandidate("sure", 16), DraftCandidate("weak", 16)], num_roots=2)
    assert got["sure"] > 0


def test_the_guards_baseline_is_a_step_without_speculations_host_time():
    """Drafted steps 10% faster per token than plain ones that spent a fifth of their time on
    speculation: faster than the steps measured, slower than a server without drafts."""
    judged, naive = SpeedGuard(), SpeedGuard()
    for _ in range(20):
        for g, spent in ((judged, 2.0), (naive, 0.0)):
            g.observe(4, 4, 10.0, drafted=False, speculation_ms=spent)
            g.observe(4, 4, 9.0, drafted=True, speculation_ms=spent)
    assert naive.hedge(4) == 1.0 and naive.loads[4].ratio() == pytest.approx(0.9)
    # Each drafted step also pays the 2 ms its plain neighbour spent: 11 ms for 4 tokens.
    assert judged.loads[4].ratio() == pytest.approx(11.0 / 8.0) and judged.hedge(4) > 2.0


def test_speculation_time_in_plain_steps_is_charged_to_the_next_drafted_one_at_most_doubling_it():
    g = SpeedGuard(keep=0.0)  # averages of the last step alone
    g.observe(2, 2, 10.0, drafted=False, speculation_ms=1.0)
    g.observe(2, 2, 10.0, drafted=False, speculation_ms=1.0)
    assert g.loads[2].plain.ms_per_token == pytest.approx(4.5)
    g.observe(2, 4, 12.0, drafted=True, speculation_ms=1.0)  # its own time counted in full
    assert g.loads[2].drafted.ms_per_token == pytest.approx(14.0 / 4)
    g.observe(2, 4, 12.0, drafted=True)
    assert g.loads[2].drafted.ms_per_token == pytest.approx(3.0)  # paid: nothing carried
    for _ in range(100):  # a long dormant spell
        g.observe(2, 2, 10.0, drafted=False, speculation_ms=1.0)
    g.observe(2, 4, 12.0, drafted=True)
    assert g.loads[2].drafted.ms_per_token == pytest.approx(24.0 / 4)


class SlowDrafter(CountingDrafter):
    """A tree search that takes a millisecond, a fifth of the allowance a 10 ms step pays."""

    def propose(self, request_id, token_ids, max_tokens):
        time.sleep(0.001)
        return super().propose(request_id, token_ids, max_tokens)


def test_a_busy_scheduler_where_no_draft_pays_stops_asking_the_policy_every_step():
    """Sixteen requests on a machine where every draft row costs a token's time: no plan ever
    drafts. Once measured, the planner pauses between plans and shadow drafts stay within the
    allowance; the steps' speculation time reaches the guard."""
    drafter, tracker = SlowDrafter(), AcceptanceTracker(16)
    policy = DraftBudgetPolicy(cpu_like(base=10.0, slope=10.0), tracker)
    config = DraftConfig(decoding_length=16, adaptive=True, plan_backoff=8, shadow_share=0.02)
    s = DraftingScheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
        config,
        BlockAllocator(512, 4),
        drafter,
        budget_policy=policy,
    )
    for i in range(16):
        s.add_request(_req(f"r{i}", 3, 500))
    calls = 0
    upper_gains_many = policy.upper_gains_many

    def counted(wanted):
        nonlocal calls
        calls += 1
        time.sleep(0.001)  # a plan costs a millisecond on any machine: five steps' allowance (0.2 ms)
        return upper_gains_many(wanted)

    policy.upper_gains_many = counted  # type: ignore[method-assign]
    shadows = []
    for _ in range(60):
        before = len(drafter.asked)
        out = s.schedule()
        assert all(r.draft is None for r in out.requests)
        shadows.append(len(drafter.asked) - before)
        s.update(out, RunnerOutput({r.request_id: [7] for r in out.requests}, {r.request_id: [] for r in out.requests}))
        s.speculation.observe_step(out, 0.010)  # 10 ms a step
    assert calls < 40  # paused between plans once dormant (before: every step)
    assert shadows[:7] == [4] * 7  # not yet dormant (8 steps without drafts): shadow_requests a step
    # Dormant: at most the allowance's (2% of 10 ms at the measured cost of a search) plus one.
    search_ms = s.speculation.host._shadow.value
    assert search_ms is not None
    assert search_ms >= 1.0
    assert 0 < sum(shadows[20:]) <= 40 * 0.02 * 10.0 / search_ms + 1
    assert s.speculation.host.spent_ms > 0


def test_a_batch_size_where_the_guards_tries_keep_losing_is_dormant():
    guard = SpeedGuard(period=1)
    b = HostBudget(share=0.02, max_skip=16, guard=guard)
    b.observe_step(10.0)
    b.searched(0.0005, shadow=True)
    assert not b.dormant(16) and b.shadows(4, num_seqs=16) == 4
    for _ in range(3):  # three tries in a row, each a drafted step slower per token than plain
        guard.observe(16, 16, 30.0, drafted=False)
        guard.observe(16, 17, 40.0, drafted=True)
    assert guard.failing(16) and b.dormant(16) and not b.dormant(16, chunked=True)
    assert b.shadows(4, num_seqs=16) <= 1
    guard.observe(16, 16, 30.0, drafted=False)
    guard.observe(16, 32, 40.0, drafted=True)  # a try that wins
    assert not guard.failing(16) and not b.dormant(16)


def test_judging_after_a_step_in_series_is_charged_to_drafting_and_beside_the_forward_is_free():
    g = SpeedGuard(keep=0.0)
    g.observe(2, 2, 10.0, drafted=False, after_ms=3.0)  # plain: the baseline keeps its wall, the 3 ms go unpaid
    assert g.loads[2].plain.ms_per_token == pytest.approx(5.0)
    g.observe(2, 4, 12.0, drafted=True, after_ms=2.0)  # its own judging and the plain step's
    assert g.loads[2].drafted.ms_per_token == pytest.approx((12.0 + 2.0 + 3.0) / 4)
    host, since = HostBudget(), time.perf_counter() - 0.002
    host.clock_after(since, in_series=False)
    assert host.take_after_ms() == 0.0
    host.clock_after(since, in_series=True)
    assert host.take_after_ms() >= 2.0 and host.take_after_ms() == 0.0  # taken once


def test_a_dormant_plan_pauses_planning_for_the_judging_and_settling_it_costs_in_series_too():
    def pauses(after_ms: float) -> int:
        host = HostBudget(share=0.1, max_skip=16)
        for _ in range(20):
            host.observe_step(10.0)  # 10 ms steps: an allowance of 1 ms a step
        while host.may_plan(4) and not host.dormant(4):  # steps whose plans drafted nothing
            pass
        host.clock_after(time.perf_counter() - after_ms / 1e3, in_series=True)
        host.take_after_ms()
        host.planned(4, False, 0.0005)  # a 0.5 ms plan that drafted nothing
        paused = 0
        while host.paused(4) and not host.may_plan(4):
            paused += 1
        return paused

    assert pauses(0.0) == 0  # the plan alone fits the allowance
    assert pauses(3.0) == 3  # with 3 ms of judging and settling after the step: 3.5 steps' allowance
