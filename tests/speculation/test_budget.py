"""The draft budget policy: acceptance tracking, allocation, step-cost learning, its settings."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from batchserve.config import SETTINGS, DraftConfig
from batchserve.cost_profile import CostProfile
from batchserve.speculation.budget import AcceptanceTracker, DraftBudgetPolicy, DraftCandidate, StepShape, WindowTracker
from batchserve.trees import MATCH_CAP
from tests.speculation.workloads import COUNTS, cpu_like, feed, gpu_like, trained


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


def test_ranks_decided_late_move_only_themselves():
    t = AcceptanceTracker(8, decay=0.5)
    t.observe("r", 1, [0])  # a step that decided rank 0 only: ranks 1.. drifted, as ever
    before = list(t._est["r"])
    t.observe_late("r", 1, 3, [1])  # later tokens decide ranks 1 (a hit) and 2 (a miss)
    after = t._est["r"]
    assert after[1] == pytest.approx(before[1] + 0.5 * (1.0 - before[1]))
    assert after[2] == pytest.approx(before[2] * 0.5)
    assert after[0] == before[0] and after[3:] == before[3:]  # no drift for the others
    t.observe_late("r", 6, 20, [7])  # past max_rank: clipped
    assert t._est["r"][7] > before[7]


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


def test_policy_drafts_where_the_drafter_is_sure():
    t = trained({"a": [0.3] * 16, "b": [0.3] * 16})  # identical histories
    feed(t.calibration, {1.0: 0.6, 0.05: 0.02}, rounds=400)
    sure, unsure = (1.0,) * 16, (0.05,) * 16
    # (The history's estimates wander around 0.3; the fit only ever saw exactly 0.3.)
    assert t.gains("a", 16, sure)[0] > 0.5 and t.gains("a", 16, unsure)[0] < 0.15
    policy = DraftBudgetPolicy(cpu_like(slope=1.0), t)
    d = policy.allocate([DraftCandidate("a", 16, sure), DraftCandidate("b", 16, unsure)], num_roots=2)
    assert d["a"] > 0 and d["b"] == 0
    # Proposal sizes are bounded by the best any score could do, so nothing sure is cut.
    assert all(u >= g for u, g in zip(t.upper_gains("a", 16), t.gains("a", 16, sure)))


def test_only_requests_whose_best_case_could_pay_are_worth_a_tree_search():
    """`hopeful` allocates on the most each node could be worth: where that gives a request
    nothing, neither can its real tree (its gains are at most those), so none is searched."""
    t = trained({"sure": [0.97] * 16, "weak": [0.1] * 16, "dead": [0.0] * 16})
    feed(t.calibration, {1.0: 0.3, 0.05: 0.02}, rounds=400)
    policy = DraftBudgetPolicy(cpu_like(slope=6.0), t)
    rids = ("sure", "weak", "dead")
    upper = [(r, policy.upper_gains(r, 16)) for r in rids]
    assert policy.upper_gains("dead", 16) == [] and len(policy.upper_gains("weak", 16)) == 16
    hopeful = policy.hopeful(upper, StepShape(3))
    assert set(hopeful) == {"sure"} and 0 < hopeful["sure"] <= 16
    # The real allocation, whatever the drafter's scores, gives no one else anything.
    for scores in ((1.0,) * 16, (0.05,) * 16):
        d = policy.allocate([DraftCandidate(r, 16, scores) for r in rids], num_roots=3)
        assert d["weak"] == d["dead"] == 0
    assert policy.allocate([DraftCandidate(r, 16) for r in rids], num_roots=3)["sure"] > 0
    # On a free step every request with a useful rank is worth its search.
    free = DraftBudgetPolicy(gpu_like(cdl=64), t)
    assert set(free.hopeful(upper, StepShape(3))) == {"sure", "weak"}
    assert free.hopeful([], StepShape(3)) == {}


def test_drafts_are_sent_only_where_they_are_predicted_to_win_by_the_margin():
    t = trained({"a": [0.5] * 4})
    profile = cpu_like()
    g = t.gains("a", 1)[0]
    predicted = (1 + g) * profile.time_ms(1) / profile.time_ms(2) - 1  # one node's speedup
    assert 0.2 < predicted < 0.6

    def drafted(margin: float, **step) -> int:
        policy = DraftBudgetPolicy(profile, t, min_speedup=margin)
        return policy.allocate([DraftCandidate("a", 1)], num_roots=1, **step)["a"]

    assert drafted(0.0) == drafted(predicted - 0.01) == 1
    assert drafted(predicted + 0.01) == 0
    # Beside a prompt chunk the win asked for is the same share of the roots' tokens.
    assert drafted(0.0, num_other_tokens=64) == 1 and drafted(0.9, num_other_tokens=64) == 0
    with pytest.raises(ValueError, match="min_speedup"):
        DraftConfig(min_speedup=1.0)


def test_scored_gains_are_non_increasing_along_the_tree():
    t = trained({"a": [0.5] * 8})
    feed(t.calibration, {1.0: 0.6, 0.05: 0.02}, rounds=200)
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


def test_a_measured_step_in_the_curve_after_16_rows_is_priced():
    # torch's int4 kernel on CPU: rows in blocks of 16, each block reading every weight again,
    # so 17 rows cost far more than 16 while 18 to 32 add little. At 16 requests, two of them
    # with a draft node of 90%: priced at the measured 17- and 18-row steps the two nodes do
    # not pay; interpolated from 16 to 32 rows they look nearly free and are drafted.
    rids = [f"r{i}" for i in range(16)]
    tracker = trained({r: [0.9] if r in ("r0", "r1") else [0.0] for r in rids}, steps=200)
    cands = [DraftCandidate(r, 1) for r in rids]

    def profile(counts: tuple[int, ...]) -> CostProfile:
        ms = {1: 10.0, 16: 13.2, 17: 20.0, 32: 24.0, 64: 60.0}
        return CostProfile("int4-like", counts, (0,), (tuple(ms[n] for n in counts),))

    # No margin (interpolated, the two nodes win by 1%): the pricing alone decides here.
    measured = DraftBudgetPolicy(profile((1, 16, 17, 32, 64)), tracker, min_speedup=0.0).allocate(cands, num_roots=16)
    assert sum(measured.values()) == 0
    interpolated = DraftBudgetPolicy(profile((1, 16, 32, 64)), tracker, min_speedup=0.0).allocate(cands, num_roots=16)
    assert interpolated == {r: int(r in ("r0", "r1")) for r in rids}


def test_draft_rows_dearer_among_many_requests_are_drafted_less():
    # A 60% node pays on the one-request curve at 8 requests; with each draft row among several
    # requests costing 2.5 ms more (measured uneven trees), fewer do, and one request alone, whose
    # chain the curve measured, is unaffected.
    rids = [f"r{i}" for i in range(8)]
    tracker = trained({r: [0.6] * 2 + [0.3] * 14 for r in rids}, steps=200)
    cands = [DraftCandidate(r, 16) for r in rids]
    p = cpu_like()
    drafty = CostProfile("x", COUNTS, p.contexts, p.step_ms, draft_ms=(2.5, 2.5))
    plain = DraftBudgetPolicy(p, tracker).allocate(cands, num_roots=8)
    dear = DraftBudgetPolicy(drafty, tracker).allocate(cands, num_roots=8)
    assert 0 < sum(dear.values()) < sum(plain.values())
    alone = [DraftCandidate("r0", 16)]
    assert DraftBudgetPolicy(drafty, tracker).allocate(alone, num_roots=1) == DraftBudgetPolicy(p, tracker).allocate(
        alone, num_roots=1
    )


def test_a_long_match_is_drafted_deeper_than_a_guess_with_the_same_scores():
    """Once the calibration has seen that long matches hit and one-token matches miss, the same
    ranks and scores are worth more nodes after a long match; and what is worth proposing
    before the tree exists (`upper_gains`) counts on the best match."""
    tracker = AcceptanceTracker(16)
    for r in range(400):
        for match, rate in ((1, 0.2), (24, 0.9)):
            tracker.calibration.observe([0.5] * 8, [0.8] * 8, [int((r + 1) * rate) > int(r * rate)] * 8, match)
    for rid, match in (("copy", 24), ("guess", 1)):
        tracker.observe(rid, 8, range(4), [0.8] * 8, match)
    scores = (0.8,) * 16
    cands = [DraftCandidate("copy", 16, scores, match=24), DraftCandidate("guess", 16, scores, match=1)]
    d = DraftBudgetPolicy(cpu_like(), tracker).allocate(cands, num_roots=2)
    assert d["copy"] > d["guess"]
    assert tracker.gains("copy", 4, scores[:4], 24) > tracker.gains("copy", 4, scores[:4], 1)
    # Before the tree: whatever the match turns out to be, so at the longest.
    assert tracker.upper_gains("guess", 4) >= tracker.gains("guess", 4, scores[:4], MATCH_CAP)


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
    assert policy.overhead_per_draft_ms == pytest.approx(0, abs=0.1)
    assert policy.scale == pytest.approx(1.0, abs=0.05)
    after = sum(policy.allocate(cands, num_roots=8).values())
    assert after > before


def test_measured_per_token_cost_makes_drafts_dearer():
    probs = [0.5 * 0.9**j for j in range(64)]
    policy = DraftBudgetPolicy(gpu_like(cdl=64), trained({"a": probs}))
    before = policy.allocate([DraftCandidate("a", 64)], num_roots=1)["a"]
    for i in range(200):  # the profile calls draft rows free, but each really costs 2 ms
        rows = 1 + i % 40
        policy.observe_step(rows, 0, 1, gpu_like(cdl=64).time_ms(rows) + 2.0 * (rows - 1))
    assert policy.overhead_per_draft_ms == pytest.approx(2.0, rel=0.05)
    assert policy.scale == pytest.approx(1.0, abs=0.05)
    after = policy.allocate([DraftCandidate("a", 64)], num_roots=1)["a"]
    assert after < before


def test_per_request_cost_seen_without_drafts_does_not_price_drafts_out():
    """Steps with drafting off have one row per request: their overhead is per request, and
    must not be split onto rows, or drafts look dear and stay off for good."""
    rids = [f"r{i}" for i in range(8)]
    probs = [0.5 * 0.9**j for j in range(64)]
    policy = DraftBudgetPolicy(cpu_like(), trained({r: probs for r in rids}))
    cands = [DraftCandidate(r, 64) for r in rids]
    before = sum(policy.allocate(cands, num_roots=8).values())
    for i in range(200):  # no drafts, 10 ms per request beyond the forward
        seqs = 4 + i % 5
        policy.observe_step(seqs, 0, seqs, cpu_like().time_ms(seqs, 0, seqs) + seqs * 10)
    assert policy.overhead_per_seq_ms == pytest.approx(10, rel=0.05)
    assert policy.overhead_per_draft_ms == pytest.approx(0, abs=1e-6)
    assert sum(policy.allocate(cands, num_roots=8).values()) >= before > 0


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


# ---- settings ------------------------------------------------------------------------------

ADAPTIVE_TUNING = (
    "initial_acceptance",
    "initial_acceptance_falloff",
    "acceptance_pool_rate",
    "calibration_decay",
    "calibration_prior_strength",
    "calibration_clip",
    "step_cost_decay",
    "step_cost_ridge",
    "step_cost_max_scale",
)


def _state(policy: DraftBudgetPolicy) -> dict:
    t, cal, fit = policy.tracker, policy.tracker.calibration, policy._step_fit
    return {
        "policy": (policy.min_gain, policy.max_scale, fit.decay, fit.strength, fit.nonneg),
        "tracker": (t.max_rank, t.decay, t.explore, t.pool_rate, t.initial, t.prior),
        "calibration": (cal.decay, cal.prior_strength, cal.clip, cal.weights),
    }


def test_from_config_defaults_are_the_plain_constructors():
    config = DraftConfig(decoding_length=32)
    built = DraftBudgetPolicy.from_config(gpu_like(), config)
    assert _state(built) == _state(DraftBudgetPolicy(gpu_like(), AcceptanceTracker(32)))
    assert DraftBudgetPolicy.from_config(gpu_like(), DraftConfig(decoding_length=0)).tracker.max_rank == 1


def test_from_config_applies_every_setting():
    config = DraftConfig(
        decoding_length=8,
        acceptance_decay=0.5,
        explore=0.1,
        min_gain=0.05,
        initial_acceptance=0.9,
        initial_acceptance_falloff=0.5,
        acceptance_pool_rate=0.1,
        calibration_decay=0.99,
        calibration_prior_strength=5.0,
        calibration_clip=0.01,
        step_cost_decay=0.9,
        step_cost_ridge=2.0,
        step_cost_max_scale=2.0,
    )
    state = _state(DraftBudgetPolicy.from_config(gpu_like(), config))
    assert state["policy"] == (0.05, 2.0, 0.9, 2.0, (1, 2))
    assert state["tracker"][:4] == (8, 0.5, 0.1, 0.1)
    assert state["tracker"][4] == pytest.approx([0.9 * 0.5**j for j in range(8)])
    assert state["calibration"][:3] == (0.99, 5.0, 0.01)


def test_max_scale_clamps_the_fitted_speed():
    policy = DraftBudgetPolicy.from_config(cpu_like(), DraftConfig(step_cost_max_scale=2.0))
    for _ in range(100):
        policy.observe_step(8, 0, 1, 10 * cpu_like().time_ms(8))
    assert policy.scale == 2.0


def test_adaptive_tuning_settings_are_settings_and_are_validated():
    for name in ADAPTIVE_TUNING:
        assert SETTINGS[name].section == "draft" and SETTINGS[name].help.startswith("adaptive: ")
    for name, bad in [
        ("initial_acceptance", 0.0),
        ("initial_acceptance_falloff", 1.5),
        ("acceptance_pool_rate", -0.1),
        ("calibration_decay", 0.0),
        ("calibration_prior_strength", 0.0),
        ("calibration_clip", 0.5),
        ("step_cost_decay", 1.01),
        ("step_cost_ridge", 0.0),
        ("step_cost_max_scale", 0.5),
    ]:
        with pytest.raises(ValueError, match=name):
            dataclasses.replace(DraftConfig(), **{name: bad})


def test_window_tracker_learns_per_request_and_an_idle_window_drifts_back():
    t = WindowTracker(initial=0.5, decay=0.5, explore=0.5, pool_rate=0.25)
    assert t.gain("new") == 0.5
    for _ in range(10):
        t.observe("good", 3)
        t.observe("bad", 0)
    assert t.gain("good") > 2.5 and t.gain("bad") < 0.01
    before = t.gain("bad")
    for _ in range(5):
        t.idle("bad")  # window off: the estimate moves back toward the pool's
    assert t.gain("bad") > before + 0.3
    t.forget("good")
    assert t.gain("good") == t.prior


def test_windows_run_where_their_gain_pays_for_their_rows_best_value_first():
    policy = DraftBudgetPolicy(cpu_like(base=80.0, slope=2.5), AcceptanceTracker(8))
    for _ in range(20):
        policy.windows.observe("sure", 3)
        policy.windows.observe("useless", 0)
    kw = dict(num_tokens=2, num_decode_tokens=2, num_roots=2, expected_tokens=2.0)
    # One token is worth ~40 ms here; 8 window rows cost 20 ms: "sure" pays, "useless" does not.
    assert policy.admit_windows([("useless", 8), ("sure", 8)], **kw) == ["sure"]
    assert policy.admit_windows([("sure", 8)], **kw, token_budget=7) == []  # does not fit
    # Prompt rows sharing the step raise its time but not the value of a decoded token.
    long_step = policy.admit_windows([("sure", 8)], **{**kw, "num_tokens": 500})
    assert long_step == ["sure"]
    steep = DraftBudgetPolicy(cpu_like(base=10.0, slope=20.0), AcceptanceTracker(8))
    steep.windows.observe("sure", 1)
    assert steep.admit_windows([("sure", 8)], **kw) == []  # 160 ms of rows for ~15 ms of tokens


@pytest.mark.parametrize("seed", range(4))
def test_the_step_takes_the_best_nodes_of_all_requests_in_order(seed):
    """The allocation against the rule written out plainly: every request's gains above
    `min_gain`, best first (ties in request order), the prefix whose tokens per ms is best
    (and a clear win), counted back per request."""
    import numpy as np

    rng = np.random.default_rng(seed)
    policy = DraftBudgetPolicy(cpu_like(), AcceptanceTracker(16), min_speedup=0.0)
    for _ in range(20):
        n = int(rng.integers(1, 9))
        gains = [
            sorted(rng.choice([0.9, 0.5, 0.3, 0.01, 0.2], size=int(rng.integers(0, 10))), reverse=True)
            for _ in range(n)
        ]
        ids = [f"r{i}" for i in range(n)]
        shape = StepShape(n, context=200.0, token_budget=int(rng.integers(0, 40)))
        lengths, expected_gain = policy._choose(ids, [list(g) for g in gains], shape)
        ranked = sorted(((g, i) for i, gs in enumerate(gains) for g in gs if g >= policy.min_gain), key=lambda x: -x[0])
        ranked = ranked[: shape.token_budget]
        rates = [
            (n + sum(g for g, _ in ranked[:k])) / policy._step_ms(n + k, k, 200.0, n) for k in range(len(ranked) + 1)
        ]
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))
        assert lengths == {rid: sum(1 for _, i in ranked[:best] if i == j) for j, rid in enumerate(ids)}
        assert expected_gain == pytest.approx(sum(g for g, _ in ranked[:best]))


def test_upper_gains_of_a_step_are_each_requests_own():
    t = trained({"a": [0.9] * 4 + [0.1] * 12, "b": [0.3] * 16})
    t.calibration.observe([0.5] * 8, [0.9] * 8, [True] * 6 + [False] * 2, 12)
    many = t.upper_gains_many([("a", 16), ("b", 5), ("new", 3)])
    assert many == [t.upper_gains("a", 16), t.upper_gains("b", 5), t.upper_gains("new", 3)]
    assert [len(g) for g in many] == [16, 5, 3] and t.upper_gains_many([]) == []


def test_steps_without_a_draft_are_counted_and_paid_in_closed_form_when_read():
    t = AcceptanceTracker(4, decay=0.5, explore=0.1, pool_rate=0.0)  # a pool that stays put
    t.observe("r", 4, [])  # every rank missed
    before, prior = list(t._est["r"]), list(t._prior("r"))
    assert before != prior
    for _ in range(7):
        t.skipped("r")
    assert t._est["r"] == before  # counted, not paid: a dormant step costs nothing per request
    t.gains("r", 4)
    assert t._est["r"] == pytest.approx([q + 0.9**7 * (e - q) for e, q in zip(before, prior)])
    pooled = AcceptanceTracker(4, explore=0.5, pool_rate=0.5)
    pooled.observe("a", 4, [])  # the pool moved away from the first guess
    moved = list(pooled._prior("a"))
    for _ in range(3):
        pooled.skipped("never drafted")  # the pool drifts back, a quarter of the way a skip
    assert pooled._prior("a") == pytest.approx([i + 0.75**3 * (m - i) for m, i in zip(moved, pooled.initial)])


def test_settling_computes_the_owed_drift_of_every_row_as_reading_each_would_to_the_bit():
    t = AcceptanceTracker(16, pool_rate=0.3)
    for rid, hits in (("a", [0, 1, 5]), ("b", [2]), ("c", [])):
        t.observe(rid, 12, hits, [0.9] * 12, 3)
    for k in range(9):
        for rid in ("a", "b", "c", "fresh")[: 1 + k % 4]:
            t.skipped(rid)
    rows = t._estimate_rows(["a", "b", "c", "fresh"]).tolist()  # the owed drift left owed
    assert t._skips["a"] == 9
    assert rows[:3] == [t._estimates(rid) for rid in ("a", "b", "c")]  # paid now: the same bits
    assert rows[3] == t._prior("fresh")  # never drafted: the prior
