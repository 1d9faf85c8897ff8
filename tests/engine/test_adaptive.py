"""Adaptive decoding length in the engine: lossless, learns acceptance, honours overrides."""

from __future__ import annotations

import pytest

from batchserve import SamplingParams
from batchserve.config import DraftConfig, EngineConfig, SchedulerConfig
from batchserve.cost_profile import CostProfile
from tests.conftest import TINY_VOCAB, hf_greedy, tiny_llm
from tests.engine.drafters import MatchTellingDrafter, OracleDrafter, RandomTreeDrafter, random_prompts

COUNTS = (1, 8, 16, 32, 64, 128, 256, 1024)
# Flat up to 32 tokens, then 0.5 ms per token: a small GPU's shape.
PROFILE = CostProfile("synthetic", COUNTS, (0,), (tuple(10.0 + 0.5 * max(0, n - 32) for n in COUNTS),))


@pytest.fixture(scope="module")
def reference(tiny_model) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): hf_greedy(tiny_model, p, 48) for p in random_prompts(8, seed=3)}


def _llm(drafter, learn_step_costs: bool = False):
    # The policy's decisions under PROFILE alone: measured step times would refine it with
    # this machine's cost per row, which differs from machine to machine.
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024),
        draft=DraftConfig(adaptive=True, decoding_length=32, learn_step_costs=learn_step_costs),
    )
    return tiny_llm(drafter, config=config, cost_profile=PROFILE)


def test_adaptive_with_good_drafts_is_lossless_and_drafts_deep(reference):
    prompts = [list(p) for p in reference]
    llm = _llm(OracleDrafter(reference, seed=0, vocab=TINY_VOCAB, depth=12))
    results = llm.generate(prompts, SamplingParams(max_new_tokens=48))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference[tuple(p)]
    accepted = sum(r.stats.draft_tokens_accepted for r in results)
    steps = sum(r.stats.steps for r in results)
    assert accepted / steps > 3  # the policy keeps drafting where drafts pay
    llm.engine.scheduler.check_integrity()
    assert llm.engine.scheduler.allocator.num_free_blocks == llm.engine.scheduler.allocator.num_blocks


def test_adaptive_with_bad_drafts_is_lossless_and_backs_off(reference):
    prompts = [list(p) for p in reference]
    llm = _llm(RandomTreeDrafter(seed=1, vocab=TINY_VOCAB, max_nodes=32))
    results = llm.generate(prompts, SamplingParams(max_new_tokens=48))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference[tuple(p)]
    proposed = sum(r.stats.draft_tokens_proposed for r in results)
    steps = sum(r.stats.steps for r in results)
    # Random trees are almost never accepted: after the first few steps the tracker stops
    # paying for them (a fixed length of 32 would verify up to 32 per step).
    assert proposed / steps < 8


def test_the_engine_teaches_the_policy_what_a_long_match_means(reference):
    """Trees whose match is long are right and trees found from one token are wrong, with the
    same scores: the engine passes each tree's match to the calibration, which learns it."""
    prompts = [list(p) for p in reference]
    llm = _llm(MatchTellingDrafter(reference, vocab=TINY_VOCAB))
    results = llm.generate(prompts, SamplingParams(max_new_tokens=48))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference[tuple(p)]
    calibration = llm.engine.speculation.policy.tracker.calibration
    assert calibration.prob(0.5, 0.8, match=24) > 0.7 > 0.3 > calibration.prob(0.5, 0.8, match=1)


def test_per_request_override_bypasses_the_policy(reference):
    prompts = [list(p) for p in reference][:4]
    llm = _llm(OracleDrafter(reference, seed=0, vocab=TINY_VOCAB, depth=12))
    params = [
        SamplingParams(max_new_tokens=48, decoding_length=0),
        SamplingParams(max_new_tokens=48, decoding_length=3),
        SamplingParams(max_new_tokens=48),
        SamplingParams(max_new_tokens=48),
    ]
    results = llm.generate(prompts, params)
    for p, r in zip(prompts, results):
        assert r.token_ids == reference[tuple(p)]
    assert results[0].stats.draft_tokens_proposed == 0 and results[0].stats.steps == 48
    # Exactly 3 drafted and accepted every step: 48 tokens in 12 steps of 3 + 1.
    assert results[1].stats.steps == 12
    assert results[1].stats.draft_tokens_proposed == results[1].stats.draft_tokens_accepted == 36


@pytest.mark.parametrize("learn", [True, False])
def test_measured_decode_steps_refine_the_profile_only_when_asked(reference, learn):
    prompts = [list(p) for p in reference][:4]
    llm = _llm(OracleDrafter(reference, seed=0, vocab=TINY_VOCAB, depth=12), learn_step_costs=learn)
    policy = llm.engine.speculation.policy
    seen: list[tuple[int, int]] = []
    observe = policy.observe_step

    def record(num_tokens: int, context: float, num_seqs: int, elapsed_ms: float) -> None:
        seen.append((num_tokens, num_seqs))
        observe(num_tokens, context, num_seqs, elapsed_ms)

    policy.observe_step = record
    results = llm.generate(prompts, SamplingParams(max_new_tokens=16))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference[tuple(p)][:16]
    if not learn:
        assert seen == [] and policy.scale == 1.0
        return
    # Every decode step is seen (prompt steps are not): one per step of the longest request.
    assert seen and all(1 <= n_seqs <= 4 and rows >= n_seqs for rows, n_seqs in seen)
    assert len(seen) >= max(r.stats.steps for r in results) - 1
