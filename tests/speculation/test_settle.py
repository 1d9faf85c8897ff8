"""The policy's estimates settled beside the forward: the numbers the next step reads are the ones
it would have built itself, and building them leaves the step's critical path."""

from __future__ import annotations

import random

import pytest

from batchserve import SamplingParams, Submission
from batchserve.bench.host import emulated_engine, pipeline, seated
from batchserve.speculation.acceptance import AcceptanceTracker
from batchserve.speculation.budget import DraftBudgetPolicy
from batchserve.speculation.fits import ScoreCalibration
from tests.conftest import TINY_VOCAB, make_tiny_tokenizer
from tests.speculation.workloads import gpu_like


def _observe_a_step(rng: random.Random, trackers: list[AcceptanceTracker], ids: list[str]) -> None:
    """One step's judging, the same on every tracker: full trees, late ranks, skipped requests."""
    for rid in ids:
        n = rng.randint(0, 24)
        scores = sorted((rng.random() for _ in range(n)), reverse=True)
        hits = rng.sample(range(n), min(n, rng.randint(0, 4)))
        match, kind = rng.randint(0, 40), rng.random()
        for t in trackers:
            if kind < 0.2:
                t.skipped(rid)
            elif kind < 0.35:
                t.observe_late(rid, 2, 2 + n, [h + 2 for h in hits], scores, match)
            else:
                t.observe(rid, n, hits, scores, match)


@pytest.mark.parametrize("seed", range(3))
def test_settled_upper_gains_are_the_ones_built_when_first_read(seed):
    """Twin trackers fed the same steps: one settles after each (the engine's order), the other
    builds its estimates when asked. Their answers and their calibrations stay equal, bit for
    bit, through forgotten requests and an id used again."""
    rng = random.Random(seed)
    settled, lazy = AcceptanceTracker(24), AcceptanceTracker(24)
    ids = [f"r{i}" for i in range(6)]
    for step in range(40):
        _observe_a_step(rng, [settled, lazy], ids)
        settled.settle(ids)
        if step % 7 == 3:  # a request ends; its id comes back as a new request
            for t in (settled, lazy):
                t.forget("r1")
        wanted = [(rid, rng.randint(0, 24)) for rid in [*ids, "new"]]
        assert settled.upper_gains_many(wanted) == lazy.upper_gains_many(wanted)
        assert settled.calibration.weights == lazy.calibration.weights


def test_an_observation_builds_every_requests_upper_gains_again():
    """Reading the estimates without settling gives what a tracker that never cached gives: an
    observation of one request moves the pool, which every request without its own estimates
    and the calibration's fit read."""
    t, fresh = AcceptanceTracker(8), AcceptanceTracker(8)
    before = t.upper_gains_many([("a", 8), ("b", 8)])
    for x in (t, fresh):
        x.observe("a", 8, [], [0.9] * 8, 12)
    after = t.upper_gains_many([("a", 8), ("b", 8)])
    assert after == fresh.upper_gains_many([("a", 8), ("b", 8)]) and after != before
    revision = t.revision
    t.forget("a")
    assert t.revision > revision and t.upper_gains("a", 8) == t.upper_gains("b", 8)  # the pool's again


@pytest.mark.parametrize("seed", range(3))
def test_a_steps_trees_are_valued_at_once_as_one_by_one(seed):
    rng = random.Random(seed)
    t = AcceptanceTracker(32)
    ids = [f"r{i}" for i in range(8)]
    for _ in range(20):
        _observe_a_step(rng, [t], ids)
        candidates = [
            (rid, rng.randint(0, 32), tuple(rng.random() for _ in range(rng.randint(0, 32))) if i % 3 else (), i * 5)
            for i, rid in enumerate([*ids, "new"])
        ]
        assert t.gains_many(candidates) == [t.gains(*c) for c in candidates]
    cal = ScoreCalibration()
    assert cal.probs_of_trees([[], [0.5]], [[], [0.9]], [0, 3]) == [[], cal.probs_each([0.5], [0.9], 3)]


def test_the_policy_keeps_its_upper_gains_until_the_tracker_moves():
    policy = DraftBudgetPolicy(gpu_like(), AcceptanceTracker(16))
    lazy = DraftBudgetPolicy(gpu_like(), AcceptanceTracker(16))
    rng = random.Random(7)
    for _ in range(10):
        _observe_a_step(rng, [policy.tracker, lazy.tracker], ["a", "b"])
        policy.settle([("a", 16), ("b", 16)])
        wanted = [("a", 16), ("b", rng.randint(0, 16)), ("c", 4)]
        assert policy.upper_gains_many(wanted) == lazy.upper_gains_many(wanted)
        kept = policy.upper_gains_many(wanted)
        assert policy.upper_gains_many(wanted) == kept and policy.upper_gains_many(wanted)[0] is kept[0]  # read again


def test_the_pipelined_loop_fits_the_calibration_beside_the_forward_never_in_a_schedule(monkeypatch):
    """The adaptive engine in the pipelined loop: the judged steps' calibration is fitted and the
    upper gains built while the next forward runs (`finish`), so planning a step only reads them."""
    core = emulated_engine(
        [[(7 * i + 3 * j) % 200 + 1 for j in range(40)] for i in range(6)],
        make_tiny_tokenizer(),
        TINY_VOCAB,
        3,
        16,
        adaptive=True,
    )
    fits = {"schedule": 0, "elsewhere": 0}
    where = ["elsewhere"]
    fit, schedule = ScoreCalibration._fit, core.schedule

    def counted_fit(self: ScoreCalibration) -> None:
        fits[where[0]] += 1
        fit(self)

    def scheduling() -> object:
        where[0] = "schedule"
        try:
            return schedule()
        finally:
            where[0] = "elsewhere"

    monkeypatch.setattr(ScoreCalibration, "_fit", counted_fit)
    monkeypatch.setattr(core, "schedule", scheduling)
    queue, pipe = [[(7 * i + 3 * j) % 200 + 1 for j in range(40)] for i in range(6)], pipeline(core)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    while queue or pipe.has_work():
        while queue and seated(core) < 3:
            core.add_request(Submission(queue.pop(0), params))
        pipe.step()
    assert fits["elsewhere"] > 0 and fits["schedule"] == 0
    assert core.speculation.policy.tracker.revision > 0
