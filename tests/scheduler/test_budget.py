"""Adaptive decoding length: cost profiles, acceptance tracking and the budget policy."""

from __future__ import annotations

import itertools
import json

import pytest

from batchserve.config import DraftConfig, SchedulerConfig
from batchserve.draft import DraftTree, NoDrafter
from batchserve.request import Request, SamplingParams
from batchserve.scheduler import BlockAllocator, RunnerOutput, Scheduler
from batchserve.scheduler.budget import (
    AcceptanceTracker,
    CostProfile,
    DraftBudgetPolicy,
    DraftCandidate,
    ScoreCalibration,
    non_increasing,
)

COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def gpu_like(cdl: int = 64, base: float = 10.0, slope: float = 0.2) -> CostProfile:
    """Flat up to `cdl` tokens, then linear: the shape the paper measures on a GPU."""
    row = tuple(base + slope * max(0, n - cdl) for n in COUNTS)
    return CostProfile("gpu-like", COUNTS, (0,), (row,))


def cpu_like(base: float = 80.0, slope: float = 2.5) -> CostProfile:
    """Linear from the first token: no free tokens at all."""
    row = tuple(base + slope * (n - 1) for n in COUNTS)
    return CostProfile("cpu-like", COUNTS, (0, 2048), (row, tuple(t * 1.5 for t in row)))


def trained(acceptance: dict[str, list[float]], steps: int = 60, max_rank: int = 64) -> AcceptanceTracker:
    """A tracker fed `steps` verifications where rank j of request r hits a fraction p[j] of
    the time, evenly spread (deterministic, so equal rates give equal estimates)."""
    t = AcceptanceTracker(max_rank)
    for s in range(steps):
        for rid, probs in acceptance.items():
            hits = [j for j, p in enumerate(probs) if int((s + 1) * p) > int(s * p)]
            t.observe(rid, len(probs), hits)
    return t


def test_profile_interpolates_extrapolates_and_round_trips(tmp_path):
    p = cpu_like()
    assert p.time_ms(1) == pytest.approx(80.0)
    assert p.time_ms(3) == pytest.approx(85.0)  # between the measured 2 and 4
    assert p.time_ms(1024) == pytest.approx(80 + 2.5 * 1023)  # the last segment extended
    assert p.time_ms(1, context=1024) == pytest.approx(100.0)  # halfway to the 1.5x context row
    assert p.time_ms(1, context=9999) > p.time_ms(1, context=2048)
    with_seqs = CostProfile("x", COUNTS, (0, 2048), p.step_ms, per_seq_ms=(0.5, 2.5))
    assert with_seqs.time_ms(16, num_seqs=16) == pytest.approx(p.time_ms(16) + 7.5)
    # Each further request costs more at longer contexts (its KV is gathered and padded).
    assert with_seqs.time_ms(16, 1024, num_seqs=16) == pytest.approx(p.time_ms(16, 1024) + 15 * 1.5)
    assert with_seqs.time_ms(16, 1024, num_seqs=1) == pytest.approx(p.time_ms(16, 1024))
    for profile in (p, with_seqs):
        profile.save(tmp_path / "p.json")
        assert CostProfile.load(tmp_path / "p.json") == profile
    with pytest.raises(ValueError, match="one entry per context"):
        CostProfile("x", COUNTS, (0, 2048), p.step_ms, per_seq_ms=(0.5,))


def test_profile_written_with_one_per_request_cost_still_loads(tmp_path):
    p = cpu_like()
    d = json.loads(p.to_json())
    d["per_seq_ms"] = 0.4  # an older profile: one number for every context
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = CostProfile.load(tmp_path / "old.json")
    assert old.per_seq_ms == (0.4,) * len(p.contexts)
    assert old.seq_ms(777) == pytest.approx(0.4)


def test_critical_decoding_length():
    assert gpu_like(cdl=64).critical_decoding_length() == 64
    assert gpu_like(cdl=16).critical_decoding_length() == 16
    assert cpu_like().critical_decoding_length() == 4  # 87.5 ms is within 10% of 80, 97.5 is not


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(token_counts=(), contexts=(0,), step_ms=()),
        dict(token_counts=(2, 1), contexts=(0,), step_ms=((1.0, 2.0),)),
        dict(token_counts=(1, 2), contexts=(0,), step_ms=((1.0,),)),
        dict(token_counts=(1, 2), contexts=(0,), step_ms=((1.0, -2.0),)),
    ],
)
def test_bad_profiles_are_refused(kwargs):
    with pytest.raises(ValueError):
        CostProfile(key="k", **kwargs)


def test_load_of_something_else_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match=r"bad\.json"):
        CostProfile.load(bad)


def test_non_increasing_keeps_prefix_totals_honest():
    xs = [0.6, 0.5, 0.1, 0.4, 0.3, 0.0]
    ys = non_increasing(xs)
    assert all(a >= b for a, b in itertools.pairwise(ys))
    assert sum(ys) == pytest.approx(sum(xs))
    assert ys[:2] == xs[:2] and ys[2] == pytest.approx(0.8 / 3)
    assert non_increasing([]) == []


def test_tracker_learns_failures_successes_and_the_pool():
    t = trained({"good": [0.95] * 8 + [0.0] * 8, "bad": [0.0] * 16})
    good, bad = t.gains("good", 16), t.gains("bad", 16)
    assert min(good[:8]) > 0.8 and max(good[8:]) < 0.05
    assert max(bad) < 0.01
    # A new request starts from the pool, which has seen both.
    fresh = t.gains("new", 16)
    assert bad[0] < fresh[0] < good[0]
    # Without drafts, a failing request drifts back toward the pool and gets retried.
    for _ in range(40):
        t.skipped("bad")
    assert t.gains("bad", 1)[0] > 0.5 * fresh[0]
    t.forget("good")
    assert t.gains("good", 16) == t.gains("never seen", 16)  # back to the pool


def test_a_streak_of_failures_does_not_silence_drafting_for_good():
    t = AcceptanceTracker(16)
    policy = DraftBudgetPolicy(cpu_like(), t)
    for _ in range(100):  # every request's drafts fail for a long while: the pool learns it too
        for rid in ("a", "b"):
            t.observe(rid, 16, [])
    assert policy.allocate([DraftCandidate("a", 16)], num_roots=1)["a"] == 0
    # No drafts, no evidence: the estimates drift back until drafting is tried again.
    steps = 0
    while policy.allocate([DraftCandidate("a", 16)], num_roots=1)["a"] == 0:
        t.skipped("a")
        steps += 1
        assert steps < 500, "drafting never resumed"
    assert steps > 5  # but not at once


def _feed(cal: ScoreCalibration, rate: dict[float, float], rounds: int, est: float = 0.3) -> None:
    """Verified trees of 8 nodes: a node scored s hits a fraction rate[s] of the time."""
    for r in range(rounds):
        scores = [s for s in rate for _ in range(8 // len(rate))]
        hits = [int((r + 1) * rate[s]) > int(r * rate[s]) for s in scores]
        cal.observe([est] * len(scores), scores, hits)


def test_calibration_starts_at_the_rank_estimate_and_learns_what_scores_mean():
    cal = ScoreCalibration()
    assert cal.prob(0.3, 0.01) == pytest.approx(0.3, abs=1e-6) == cal.prob(0.3, 1.0)
    # The drafter is overconfident: its score-1 nodes hit 40%, its score-0.1 nodes 5%.
    _feed(cal, {1.0: 0.4, 0.1: 0.05}, rounds=400)
    assert cal.prob(0.3, 1.0) == pytest.approx(0.4, abs=0.05)
    assert cal.prob(0.3, 0.1) == pytest.approx(0.05, abs=0.03)
    # When what scores mean changes (another workload), the fit follows.
    _feed(cal, {1.0: 0.8, 0.1: 0.3}, rounds=1000)
    assert cal.prob(0.3, 1.0) == pytest.approx(0.8, abs=0.05)
    assert cal.prob(0.3, 0.1) == pytest.approx(0.3, abs=0.05)


def test_calibration_keeps_the_request_history_in_the_estimate():
    cal = ScoreCalibration()
    for r in range(600):  # same scores; the request whose ranks hit more often hits more
        for est, rate in ((0.6, 0.6), (0.1, 0.1)):
            cal.observe([est] * 8, [0.5] * 8, [int((r + 1) * rate) > int(r * rate)] * 8)
    assert cal.prob(0.6, 0.5) == pytest.approx(0.6, abs=0.07)
    assert cal.prob(0.1, 0.5) == pytest.approx(0.1, abs=0.05)


def test_policy_drafts_where_the_drafter_is_sure():
    t = trained({"a": [0.3] * 16, "b": [0.3] * 16})  # identical histories
    _feed(t.calibration, {1.0: 0.6, 0.05: 0.02}, rounds=400)
    sure, unsure = (1.0,) * 16, (0.05,) * 16
    # (The history's estimates wander around 0.3; the fit only ever saw exactly 0.3.)
    assert t.gains("a", 16, sure)[0] > 0.5 and t.gains("a", 16, unsure)[0] < 0.15
    policy = DraftBudgetPolicy(cpu_like(slope=1.0), t)
    d = policy.allocate([DraftCandidate("a", 16, sure), DraftCandidate("b", 16, unsure)], num_roots=2)
    assert d["a"] > 0 and d["b"] == 0
    # Proposal sizes are bounded by the best any score could do, so nothing sure is cut.
    assert all(u >= g for u, g in zip(t.upper_gains("a", 16), t.gains("a", 16, sure)))


def test_scored_gains_are_non_increasing_along_the_tree():
    t = trained({"a": [0.5] * 8})
    _feed(t.calibration, {1.0: 0.6, 0.05: 0.02}, rounds=200)
    g = t.gains("a", 8, (0.05, 1.0, 1.0, 0.05, 1.0, 0.05, 0.05, 0.05))
    assert len(g) == 8 and all(a >= b for a, b in itertools.pairwise(g))


def test_policy_drafts_freely_while_tokens_are_free():
    policy = DraftBudgetPolicy(gpu_like(cdl=64), trained({"a": [0.5] * 64}))
    one = policy.allocate([DraftCandidate("a", 64)], num_roots=1)
    assert one["a"] >= 60  # 1 root + up to 63 drafts cost no more than one token
    # Sixteen requests share the same free room: about (64 - 16) / 16 tokens each.
    rids = [f"r{i}" for i in range(16)]
    policy = DraftBudgetPolicy(gpu_like(cdl=64), AcceptanceTracker(64))  # all at the same prior
    many = policy.allocate([DraftCandidate(r, 64) for r in rids], num_roots=16)
    total = sum(many.values())
    assert 40 <= total <= 56
    assert max(many.values()) - min(many.values()) <= 1  # equal gains, equal shares


def test_policy_budget_shrinks_with_batch_size_and_never_exceeds_the_cap():
    probs = [0.9 * 0.85**j for j in range(64)]
    means = []
    for b in (1, 2, 4, 8, 16):
        rids = [f"r{i}" for i in range(b)]
        policy = DraftBudgetPolicy(cpu_like(), trained({r: probs for r in rids}))
        d = policy.allocate([DraftCandidate(r, 64) for r in rids], num_roots=b, token_budget=100)
        assert sum(d.values()) <= 100
        means.append(sum(d.values()) / b)
    assert means[0] > means[-1] > 0
    assert all(a >= b for a, b in itertools.pairwise(means))


def test_policy_gives_failing_requests_nothing():
    t = trained({"good": [0.9] * 16, "bad": [0.0] * 16})
    d = DraftBudgetPolicy(gpu_like(cdl=64), t).allocate(
        [DraftCandidate("good", 16), DraftCandidate("bad", 16)], num_roots=2
    )
    assert d == {"good": 16, "bad": 0}


def test_policy_only_pays_for_drafts_that_beat_their_cost():
    # On a linear profile a draft token costs 2.5 ms and one emitted token is worth about
    # 80 ms: a node accepted 60% of the time pays, one accepted 5% of the time does not.
    t = trained({"a": [0.6] * 4 + [0.05] * 60}, steps=210)
    d = DraftBudgetPolicy(cpu_like(), t, min_gain=0.0).allocate([DraftCandidate("a", 64)], num_roots=1)
    assert d["a"] == 4


def test_prefill_chunks_sharing_the_step_are_paid_for_anyway():
    rids = ["a", "b", "c", "d"]
    t = trained({r: [1.0] * 4 + [0.2] * 60 for r in rids}, steps=200)
    policy = DraftBudgetPolicy(gpu_like(cdl=64, slope=0.2), t)
    cands = [DraftCandidate(r, 64) for r in rids]
    alone = policy.allocate(cands, num_roots=4)
    assert sum(alone.values()) == 60  # exactly the free room
    # A 256-token prompt chunk takes the step past the free region, where a draft token
    # costs 0.2 ms: the sure nodes still pay for themselves, the 20% ones no longer do.
    shared = policy.allocate(cands, num_roots=4, num_other_tokens=256)
    assert shared == {r: 4 for r in rids}
    # A chunk that still fits the free region only takes its own rows out of it.
    small = policy.allocate(cands, num_roots=4, num_other_tokens=8)
    assert sum(small.values()) >= sum(alone.values()) - 8


def test_measured_engine_overhead_makes_drafts_cheaper():
    rids = [f"r{i}" for i in range(8)]
    probs = [0.5 * 0.9**j for j in range(64)]
    policy = DraftBudgetPolicy(cpu_like(), trained({r: probs for r in rids}))
    cands = [DraftCandidate(r, 64) for r in rids]
    before = sum(policy.allocate(cands, num_roots=8).values())
    for i in range(200):  # each step really takes 40 ms per request more than the forward
        rows = 8 + i % 24
        policy.observe_step(rows, 0, 8, cpu_like().time_ms(rows) + 8 * 40)
    assert policy.overhead_per_seq_ms == pytest.approx(40, rel=0.05)
    assert policy.overhead_per_token_ms == pytest.approx(0, abs=0.1)
    assert policy.scale == pytest.approx(1.0, abs=0.05)
    after = sum(policy.allocate(cands, num_roots=8).values())
    assert after > before


def test_measured_per_token_cost_makes_drafts_dearer():
    probs = [0.5 * 0.9**j for j in range(64)]
    policy = DraftBudgetPolicy(gpu_like(cdl=64), trained({"a": probs}))
    before = policy.allocate([DraftCandidate("a", 64)], num_roots=1)["a"]
    for i in range(200):  # the profile calls rows free, but each really costs 2 ms
        rows = 1 + i % 40
        policy.observe_step(rows, 0, 1, gpu_like(cdl=64).time_ms(rows) + 2.0 * rows)
    assert policy.overhead_per_token_ms == pytest.approx(2.0, rel=0.05)
    assert policy.scale == pytest.approx(1.0, abs=0.05)
    after = policy.allocate([DraftCandidate("a", 64)], num_roots=1)["a"]
    assert after < before


@pytest.mark.parametrize("slowdown", [0.7, 1.5, 3.0, 15.0])
@pytest.mark.parametrize("num_seqs", [1, 16])
def test_a_uniformly_slower_machine_changes_no_decision(slowdown, num_seqs):
    """Other load on the machine stretches every step alike: the fit calls it a scale, not
    a per-request or per-row cost, so draft lengths stay what the profile says."""
    rids = [f"r{i}" for i in range(num_seqs)]
    probs = [0.6 * 0.85**j for j in range(64)]
    profile = CostProfile("x", COUNTS, (0, 2048), cpu_like().step_ms, per_seq_ms=(0.8, 25.0))
    policy = DraftBudgetPolicy(profile, trained({r: probs for r in rids}))
    cands = [DraftCandidate(r, 64) for r in rids]
    before = policy.allocate(cands, num_roots=num_seqs, context=300)
    for i in range(150):  # the steps the policy itself would run, drafts varying a little
        rows = num_seqs + sum(before.values()) + (i % 5) - 2
        policy.observe_step(max(1, rows), 300, num_seqs, slowdown * profile.time_ms(max(1, rows), 300, num_seqs))
    limit = 1.05 if 4.0 >= slowdown >= 0.25 else None  # the scale is clamped to [0.25, 4]
    if limit is not None:
        assert policy.scale == pytest.approx(slowdown, rel=0.05)
    assert policy.allocate(cands, num_roots=num_seqs, context=300) == before


# ---- in the scheduler ---------------------------------------------------------------------


class WideDrafter(NoDrafter):
    """Proposes `max_tokens` nodes: a root child 10 with a chain below it, then siblings."""

    def propose(self, request_id, token_ids, max_tokens):
        n = min(max_tokens, 32)
        tokens = [10 + i for i in range(n)]
        parents: list[int | None] = [None] + [i - 1 if i < n // 2 else None for i in range(1, n)]
        return DraftTree(tuple(tokens), tuple(parents)) if n else None


def _req(rid: str, **kw) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=200, **kw), frozenset([0]), max_total_len=4096)


class CountingDrafter(WideDrafter):
    def __init__(self) -> None:
        self.asked: list[int] = []

    def propose(self, request_id, token_ids, max_tokens):
        self.asked.append(max_tokens)
        return super().propose(request_id, token_ids, max_tokens)


def test_scheduler_proposes_only_what_the_policy_could_give():
    tracker = AcceptanceTracker(32)
    drafter = CountingDrafter()
    s = Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256),
        DraftConfig(decoding_length=32, adaptive=True),
        BlockAllocator(256, 4),
        drafter,
        budget_policy=DraftBudgetPolicy(gpu_like(cdl=16), tracker, min_gain=0.2),
    )
    s.add_request(_req("silenced"))
    s.add_request(_req("good"))
    for _ in range(50):
        tracker.observe("silenced", 32, [])  # every draft rejected
        tracker.observe("good", 5, range(5))  # its 5 nodes always accepted
    out = s.schedule()
    # Only the good request's 5 sure ranks clear min_gain: the trie is asked for exactly
    # those, and not at all for the silenced request.
    assert drafter.asked == [5]
    assert {r.request_id: r.draft is None for r in out.requests} == {"silenced": True, "good": False}


def test_scheduler_applies_policy_overrides_and_feeds_acceptance():
    tracker = AcceptanceTracker(32)
    policy = DraftBudgetPolicy(gpu_like(cdl=16), tracker)
    s = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
        DraftConfig(decoding_length=32, adaptive=True),
        BlockAllocator(256, 4),
        WideDrafter(),
        budget_policy=policy,
    )
    s.add_request(_req("auto"))
    s.add_request(_req("fixed", decoding_length=5))
    s.add_request(_req("off", decoding_length=0))
    out = s.schedule()  # prefill step: every request samples
    drafts = {r.request_id: r.draft for r in out.requests}
    assert len(drafts["fixed"]) == 5 and drafts["off"] is None
    # The step already holds 9 prompt tokens and 5 fixed drafts, 2 short of the 16 free rows;
    # since those are paid for anyway the adaptive request gets more than 2, but not its cap.
    assert 2 < len(drafts["auto"]) < 32
    assert all(r.num_tokens <= len(r.token_ids) + 32 for r in out.requests)
    # `auto` accepts its first two chain nodes (ranks 0 and 1): those ranks go up, rank 2 down.
    auto = drafts["auto"]
    emitted = {"auto": [10, 11, 99], "fixed": [99], "off": [99]}
    accepted = {"auto": [0, 1], "fixed": [], "off": []}
    before = tracker.gains("auto", 3)
    s.update(out, RunnerOutput(emitted, accepted))
    after = tracker._est["auto"]
    assert auto is not None and len(auto) >= 3
    assert after[0] > before[0] and after[1] > before[1] and after[2] < before[2]
    s.check_integrity()
