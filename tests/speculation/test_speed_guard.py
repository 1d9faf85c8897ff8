"""The speed guard: measured speed with and without drafts, per batch size, and what it makes
the policy and the scheduler do."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from batchserve.config import DraftConfig, SchedulerConfig
from batchserve.records import RunnerOutput
from batchserve.request import Request, SamplingParams
from batchserve.scheduler import BlockAllocator
from batchserve.speculation.budget import AcceptanceTracker, DraftBudgetPolicy, DraftCandidate
from batchserve.speculation.speed_guard import SpeedGuard
from tests.scheduler.drafting import DraftingScheduler
from tests.scheduler.test_scheduler import TruthDrafter
from tests.speculation.workloads import cpu_like, trained


def test_batch_sizes_share_a_state_by_power_of_two():
    assert [SpeedGuard.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 64]
    g = SpeedGuard(period=4)
    g.observe(3, 2, 10.0, drafted=True)
    assert g.loads.keys() == {4} and g.hedge(4) == 1.0 and g.hedge(16) == 1.0


def test_a_baseline_step_is_due_after_period_drafted_steps_and_less_often_on_a_clear_win():
    g = SpeedGuard(period=4)
    assert not g.wants_plain(8)  # nothing measured: draft first
    g.observe(8, 8, 100.0, drafted=True)
    assert g.wants_plain(8)  # no baseline yet
    g.observe(8, 8, 100.0, drafted=False)
    due = []
    for _ in range(20):
        due.append(g.wants_plain(8))
        g.observe(8, 9, 110.0, drafted=True)  # about break-even: check every `period` steps
    assert due.index(True) == 4
    g.observe(8, 8, 100.0, drafted=False)
    for _ in range(15):
        g.observe(8, 16, 100.0, drafted=True)  # twice as fast: the baseline is refreshed 4x less often
        assert not g.wants_plain(8)
    g.observe(8, 16, 100.0, drafted=True)
    assert g.wants_plain(8)


def test_the_hedge_rises_while_drafts_lose_and_falls_back_while_they_win():
    g = SpeedGuard(period=1000, rate=0.5, max_hedge=8.0)
    g.observe(16, 16, 130.0, drafted=False)  # 8.1 ms per token without drafts
    for _ in range(30):
        g.observe(16, 20, 200.0, drafted=True)  # 10 ms per token with them: slower
    assert g.loads[16].ratio() == pytest.approx(10 / 8.125)
    assert 4.0 < g.hedge(16) <= 8.0
    for _ in range(200):
        g.observe(16, 30, 150.0, drafted=True)  # now 5 ms per token: drafts pay
    assert g.hedge(16) == 1.0
    assert g.hedge(1) == 1.0  # other batch sizes are their own business


def test_speed_is_a_ratio_of_sums_not_a_mean_of_ratios():
    g = SpeedGuard(keep=0.9)
    g.observe(1, 1, 40.0, drafted=False)
    for tokens, ms in [(2, 40.0)] * 10 + [(1, 60.0)]:
        g.observe(1, tokens, ms, drafted=True)
    # (0.9 * 40 + 0.1 * 60) ms over (0.9 * 2 + 0.1 * 1) tokens; an average of per-step ratios would
    # give 0.9 * 20 + 0.1 * 60 = 24: one slow one-token step would count as much as a fast one.
    assert g.loads[1].drafted.ms_per_token == pytest.approx(42.0 / 1.9)
    assert g.loads[1].ratio() == pytest.approx(42.0 / 1.9 / 40.0)


def test_steps_without_drafts_relax_the_hedge_so_drafting_is_tried_again():
    g = SpeedGuard(period=1000, rate=1.0, max_hedge=16.0, relax=0.05)
    g.observe(4, 4, 40.0, drafted=False)
    for _ in range(40):
        g.observe(4, 4, 80.0, drafted=True)
    assert g.hedge(4) == 16.0
    for _ in range(100):
        g.observe(4, 4, 40.0, drafted=False)  # drafting is off: plain steps only
    assert g.hedge(4) < 1.2


def test_probes_that_keep_failing_are_retried_less_and_less_often():
    """Where the cost model is wrong, every try at drafting is slower: the hedge relaxes more
    slowly after each failed try in a row (past the first), so tries get rarer; a try that wins
    restores the pace."""
    g = SpeedGuard(period=1000, rate=1.0, max_hedge=16.0, relax=0.2)
    g.observe(4, 4, 40.0, drafted=False)

    def plain_steps_until_a_try() -> int:  # the policy drafts again once the hedge is below 2
        n = 0
        while g.hedge(4) >= 2.0:
            g.observe(4, 4, 40.0, drafted=False)
            n += 1
        return n

    gaps = []
    for _ in range(5):
        for _ in range(10):
            g.observe(4, 4, 80.0, drafted=True)  # a failed try: twice as slow per token
        gaps.append(plain_steps_until_a_try())
    assert gaps[1] > 1.5 * gaps[0] and gaps[2] > 1.5 * gaps[1]  # each failure past the first
    assert gaps[4] == gaps[3]  # at the most backoff
    g.observe(4, 8, 40.0, drafted=True)  # a try that wins
    for _ in range(10):
        g.observe(4, 4, 80.0, drafted=True)
    assert plain_steps_until_a_try() == gaps[0]  # back to the first pace


def test_a_bad_measurement_changes_nothing():
    g = SpeedGuard()
    for n, tokens, ms in [(0, 1, 10.0), (1, 0, 10.0), (1, 1, 0.0), (1, 1, -3.0)]:
        g.observe(n, tokens, ms, drafted=True)
    assert g.loads == {}
    with pytest.raises(ValueError):
        SpeedGuard(period=0)


def test_the_policy_drafts_less_under_a_hedge_and_counts_the_true_gain():
    t = trained({"a": [0.9] * 16, "b": [0.6] * 16, "c": [0.4] * 16, "d": [0.2] * 16})
    guard = SpeedGuard()
    policy = DraftBudgetPolicy(cpu_like(base=80.0, slope=3.0), t, guard=guard)
    cands = [DraftCandidate(r, 16) for r in "abcd"]
    free = policy.allocate(cands, num_roots=4)
    planned = policy.planned_gain
    assert sum(free.values()) > 0 and planned > 0
    guard.observe(4, 4, 40.0, drafted=False)
    for _ in range(3):
        guard.observe(4, 5, 80.0, drafted=True)  # drafted steps measured 1.6x slower per token
    assert guard.hedge(4) > 2
    hedged = policy.allocate(cands, num_roots=4)
    assert sum(hedged.values()) < sum(free.values())
    assert hedged["c"] < free["c"] and hedged["a"] == free["a"]  # the least sure drafts go first
    # What the kept nodes are expected to buy is still counted in full (the window's tau uses it).
    assert sum(hedged.values()) > 0  # the surest nodes still pay at this hedge
    true_gain = sum(sum(t.gains(r, n)) for r, n in hedged.items())
    assert policy.planned_gain == pytest.approx(true_gain) and policy.planned_gain < planned


def test_the_settings_build_the_guard():
    cfg = DraftConfig(adaptive=True, guard_period=7, guard_max_hedge=3.0)
    policy = DraftBudgetPolicy.from_config(cpu_like(), cfg)
    assert policy.guard is not None and policy.guard.period == 7 and policy.guard.max_hedge == 3.0
    assert DraftBudgetPolicy.from_config(cpu_like(), DraftConfig(adaptive=True, speed_guard=False)).guard is None
    for bad in ({"guard_period": 0}, {"guard_decay": 1.0}, {"guard_rate": 0.0}, {"guard_max_hedge": 0.5}):
        with pytest.raises(ValueError):
            DraftConfig(**bad)


def _guarded_scheduler(period: int, slope: float, seats: int = 2) -> tuple[DraftingScheduler, SpeedGuard]:
    """Two long requests "a" and "b" on a policy with a guard; `seats` running at most."""
    guard = SpeedGuard(period=period)
    # No margin: what these tests see is the guard's doing alone (and prompts are not paced beside
    # decodes, which would leave a step of the slow "machine" without its prompt: test_pacing.py).
    policy = DraftBudgetPolicy(cpu_like(base=80.0, slope=slope), AcceptanceTracker(8), guard=guard, min_speedup=0.0)
    s = DraftingScheduler(
        SchedulerConfig(max_num_seqs=seats, max_num_batched_tokens=256, prompt_stall=float("inf")),
        DraftConfig(decoding_length=8, adaptive=True),
        BlockAllocator(1024, 4),
        TruthDrafter(),
        budget_policy=policy,
    )
    for rid in ("a", "b"):
        s.add_request(Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=400), frozenset([0]), max_total_len=4096))
    return s, guard


def _truth_step(s: DraftingScheduler, ms_of: Callable[[int], float]) -> int:
    """One step where the model emits the true text (position p holds 10 + p % 50), so every
    draft node is accepted; the step takes `ms_of(rows)`. The draft rows it verified."""
    out = s.schedule()
    emitted, accepted, rows = {}, {}, 0
    for item in out.requests:
        n = len(item.draft) if item.draft is not None else 0
        rows += n
        if item.sample:
            start = len(s.requests[item.request_id].all_token_ids)
            emitted[item.request_id] = [10 + (start + i) % 50 for i in range(n + 1)]
            accepted[item.request_id] = list(range(n))
    s.update(out, RunnerOutput(emitted, accepted))
    s.speculation.observe_step(out, ms_of(out.num_tokens) / 1e3)
    return rows


def test_the_scheduler_runs_baseline_steps_that_still_judge_the_proposals():
    s, guard = _guarded_scheduler(period=3, slope=0.5)
    _truth_step(s, lambda rows: 100.0)  # the prompts
    drafted = [_truth_step(s, lambda rows: 100.0) for _ in range(40)]
    plain = [i for i, n in enumerate(drafted) if n == 0]
    assert len(plain) >= 2
    # A clear win: four times `period` drafted steps between two baselines.
    assert all(b - a == 4 * 3 + 1 for a, b in itertools.pairwise(plain))
    # Perfect drafts at a flat step cost: drafted steps measure far faster; the guard stays out of the way.
    assert guard.loads[2].ratio() < 0.5 and guard.hedge(2) == 1.0
    # The baseline steps judged their proposals: the estimates kept up with the truth.
    assert s.speculation.policy.tracker.gains("a", 1)[0] > 0.9


def test_where_draft_rows_cost_more_than_they_buy_the_guard_turns_drafting_off():
    """The profile prices a row at 5 ms; the 'machine' charges 100 ms per draft row. Every draft is
    accepted, yet a drafted step emits tokens slower than a plain one."""
    s, guard = _guarded_scheduler(period=4, slope=5.0)
    _truth_step(s, lambda rows: 100.0)

    def machine(rows: int) -> float:
        return 100.0 + 100.0 * (rows - 2)

    drafted = [_truth_step(s, machine) for _ in range(150)]
    assert guard.loads[2].ratio() is not None and guard.hedge(2) > 4
    assert sum(drafted[:20]) > 0 and sum(drafted[-50:]) < 0.2 * sum(drafted[:50])


def test_steps_with_a_prompt_chunk_are_judged_apart_from_decode_only_ones():
    g = SpeedGuard(period=1000, rate=0.5, max_hedge=8.0)
    g.observe(16, 16, 130.0, drafted=False)  # decode-only: 8.1 ms per token
    for _ in range(30):
        g.observe(16, 20, 100.0, drafted=True)  # decode-only with drafts: 5 ms per token, they pay
    g.observe(16, 16, 400.0, drafted=False, chunked=True)  # a chunk's rows: 25 ms per token
    for _ in range(30):
        g.observe(16, 17, 600.0, drafted=True, chunked=True)  # with drafts beside a chunk: slower
    assert g.loads[16].ratio() < 1 and g.hedge(16) == 1.0  # the slow chunk steps did not count here
    assert g.chunked_loads[16].ratio() > 1 and g.hedge(16, chunked=True) > 4
    assert not g.wants_plain(16) and g.wants_plain(16, chunked=True) is False  # period 1000
    fresh = SpeedGuard(period=2)
    fresh.observe(4, 4, 50.0, drafted=True, chunked=True)
    assert fresh.wants_plain(4, chunked=True) and not fresh.wants_plain(4)  # each kind has its baseline


def test_an_overloaded_server_whose_every_step_carries_a_prompt_still_gets_guarded():
    """A new request arrives at every step, so no step is decode-only; the 'machine' charges 100
    ms per draft row while the profile prices it at 5: the guard must still turn drafting off."""
    s, guard = _guarded_scheduler(period=4, slope=5.0, seats=3)
    _truth_step(s, lambda rows: 100.0)  # the long requests' prompts

    def machine(rows: int) -> float:
        return 100.0 + 100.0 * max(0, rows - 5)  # two decode rows and a 3-token prompt are the base

    drafted = []
    for i in range(150):  # a one-token request arrives every step: its prompt rides along
        s.add_request(Request(f"q{i}", [1, 2, 3], SamplingParams(max_new_tokens=1), frozenset([0]), max_total_len=64))
        drafted.append(_truth_step(s, machine))
    assert guard.loads == {}  # not one decode-only step
    assert guard.chunked_loads[4].ratio() is not None and guard.hedge(4, chunked=True) > 4
    assert sum(drafted[:20]) > 0 and sum(drafted[-50:]) < 0.2 * sum(drafted[:50])
    assert {"a", "b"} <= set(s.requests) and len(s.requests) == 2  # every one-token request finished
