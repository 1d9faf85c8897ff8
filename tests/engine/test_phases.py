"""Step phase accounting: every step's phases are timed and add up to its wall time."""

from __future__ import annotations

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.records import SchedulerOutput, StepPhases
from tests.conftest import TINY_VOCAB, make_tiny_model, make_tiny_tokenizer
from tests.engine.drafters import RandomTreeDrafter


def _core():
    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig
    from batchserve.engine import EngineCore

    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        draft=DraftConfig(decoding_length=8, adaptive=False),
    )
    drafter = RandomTreeDrafter(seed=3, vocab=TINY_VOCAB, max_nodes=8)
    return EngineCore(config, make_tiny_model(), make_tiny_tokenizer(), drafter)


def test_phases_add_up_to_the_step_wall():
    core = _core()
    seen: list[tuple[SchedulerOutput, StepPhases]] = []
    core.step_listeners.append(lambda out, phases: seen.append((out, phases)))
    # Two rounds, drafted and then plain, so that each kind of step has many samples: the check
    # below takes a median, which a single step (one OS preemption) would decide on its own.
    emitted = 0
    for decoding_length in (None, 0):
        for i in range(8):
            params = SamplingParams(max_new_tokens=24, ignore_eos=True, decoding_length=decoding_length)
            core.add_request(Submission([1 + i, 2, 3, 4, 5, 6] * (1 + i), params))
        while core.has_work():
            emitted += sum(len(o.new_token_ids) for o in core.step())
    assert emitted == 2 * 8 * 24 == sum(p.tokens for _, p in seen)  # each step counts what it emitted
    assert len(seen) == core.num_steps >= 2 * 24
    assert any(out.requests and any(r.draft for r in out.requests) for out, _ in seen)  # drafts were verified
    for out, phases in seen:
        times = dict(phases.items())
        assert set(times) == {"schedule", "prepare", "forward", "verify", "commit"}
        assert all(t >= 0 for t in times.values()) and phases.wall > 0
        assert sum(times.values()) <= phases.wall * (1 + 1e-9)  # phases never overlap
        if out.requests:
            assert phases.forward > 0 and phases.prepare > 0 and phases.verify > 0
            # The CPU backend times itself: inside the forward, never more than it.
            assert phases.attention is not None and 0 < phases.attention < phases.forward
    # What no phase covers (handing the step between them) is under 5% of the wall time, in the
    # typical step with drafts and without: work left untimed would show in every such step,
    # while a preemption by the OS between two phases (a shared machine) lands in one or two.
    for drafted in (True, False):
        shares = sorted(
            sum(t for _, t in p.items()) / p.wall
            for out, p in seen
            if out.requests and any(r.draft for r in out.requests) == drafted
        )
        assert len(shares) >= 10 and shares[len(shares) // 2] >= 0.95, (drafted, shares)
    # ... and over the whole run, a gap in only some steps (one preemption costs a few percent).
    covered = sum(sum(t for _, t in p.items()) for _, p in seen)
    assert covered >= 0.90 * sum(p.wall for _, p in seen)


def test_a_failing_listener_does_not_stop_the_engine():
    core = _core()

    def broken(out, phases):
        raise RuntimeError("metrics bug")

    core.step_listeners.append(broken)
    core.add_request(Submission([1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True)))
    outputs = []
    while core.has_work():
        outputs += core.step()
    assert outputs[-1].finished and outputs[-1].num_output_tokens == 5
