"""Faults injected at every point of a step: only the requests that must fail do, every
stream gets its final message, and the engine goes on (or stops for good, loudly)."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace

import pytest

from batchserve import AsyncEngine, FinishReason, SamplingParams
from batchserve.admission import Submission
from batchserve.async_engine import EngineDeadError
from batchserve.engine import EngineCore
from tests.conftest import TINY_VOCAB, hf_greedy, make_tiny_model, make_tiny_tokenizer
from tests.engine.drafters import RandomTreeDrafter

PROMPTS = {f"r{i}": [1 + i, 2, 3, 4 + i, 5] for i in range(5)}
PARAMS = SamplingParams(max_new_tokens=16, ignore_eos=True)


def _core(drafter=None, adaptive: bool = False) -> EngineCore:
    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig
    from tests.speculation.workloads import gpu_like

    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        draft=DraftConfig(decoding_length=8, adaptive=adaptive, learn_step_costs=False),
    )
    drafter = drafter or RandomTreeDrafter(1, TINY_VOCAB, 8)
    profile = gpu_like(cdl=16) if adaptive else None
    return EngineCore(config, make_tiny_model(), make_tiny_tokenizer(), drafter, cost_profile=profile)


def _run(core: EngineCore) -> tuple[dict[str, list[int]], dict]:
    for rid, p in PROMPTS.items():
        core.add_request(Submission(p, PARAMS, request_id=rid))
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    finals = {}
    while core.has_work():
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                finals[o.request_id] = o
    assert set(finals) == set(PROMPTS)  # every request got its final output
    pool = core.scheduler.allocator
    assert pool.num_free_blocks == pool.num_blocks and not core.scheduler.requests
    core.scheduler.check_integrity()
    return tokens, finals


def _assert_only(finals: dict, bad: str, message: str, tokens: dict, tiny_model) -> None:
    assert finals[bad].finish_reason is FinishReason.ERROR and message in (finals[bad].error or "")
    for rid, p in PROMPTS.items():
        if rid != bad:
            assert finals[rid].finish_reason is FinishReason.LENGTH and finals[rid].error is None
            assert tokens[rid] == hf_greedy(tiny_model, p, 16, ignore_eos=True)


def test_a_request_whose_forward_always_fails_fails_alone(tiny_model, monkeypatch):
    core = _core()
    real = core.runner.launch

    def poisoned(out):
        if any(r.request_id == "r2" for r in out.requests):
            raise RuntimeError("poisoned input")
        return real(out)

    monkeypatch.setattr(core.runner, "launch", poisoned)
    tokens, finals = _run(core)
    _assert_only(finals, "r2", "poisoned input", tokens, tiny_model)
    assert core.consecutive_failed_steps == 0


def test_a_drafter_that_raises_costs_the_draft_not_the_request(tiny_model):
    class Broken(RandomTreeDrafter):
        def propose(self, request_id, token_ids, max_tokens):
            if request_id == "r1":
                raise KeyError("trie bug")
            return super().propose(request_id, token_ids, max_tokens)

    tokens, finals = _run(_core(Broken(2, TINY_VOCAB, 8)))
    for rid, p in PROMPTS.items():
        assert finals[rid].finish_reason is FinishReason.LENGTH
        assert tokens[rid] == hf_greedy(tiny_model, p, 16, ignore_eos=True)
    assert finals["r1"].stats.draft_tokens_proposed == 0 < finals["r0"].stats.draft_tokens_proposed


def test_a_draft_budget_that_raises_costs_the_drafts_not_the_requests(tiny_model, monkeypatch):
    core = _core(adaptive=True)
    policy = core.speculation.policy
    assert policy is not None

    def broken(*args, **kwargs):
        raise ZeroDivisionError("budget bug")

    monkeypatch.setattr(policy, "allocate", broken)
    tokens, finals = _run(core)
    for rid, p in PROMPTS.items():
        assert finals[rid].finish_reason is FinishReason.LENGTH
        assert tokens[rid] == hf_greedy(tiny_model, p, 16, ignore_eos=True)


@pytest.mark.parametrize("stop", [(), ("\x00never",)], ids=["detokenized-after-advance", "stop-strings"])
def test_a_detokenizer_error_of_one_request_fails_only_it(tiny_model, monkeypatch, stop):
    # Without stop strings a request's text is decoded when its outputs are built (`finish`);
    # with them, as its tokens are committed (`advance`): an error in either fails only it.
    core = _core()
    real = core.detok.on_token
    seen = {"n": 0}

    def detokenizer_bug(request_id, token_id):
        if request_id == "r3":
            seen["n"] += 1
            if seen["n"] == 5:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(request_id, token_id)

    monkeypatch.setattr(core.detok, "on_token", detokenizer_bug)
    monkeypatch.setattr(sys.modules[__name__], "PARAMS", replace(PARAMS, stop=stop))
    tokens, finals = _run(core)
    _assert_only(finals, "r3", "injected", tokens, tiny_model)


def test_a_drafter_that_raises_while_forgetting_a_request_frees_it_anyway():
    class Broken(RandomTreeDrafter):
        def on_request_finish(self, request_id):
            raise RuntimeError("forget bug")

    _tokens, finals = _run(_core(Broken(3, TINY_VOCAB, 8)))
    assert {o.finish_reason for o in finals.values()} == {FinishReason.LENGTH}


async def test_an_engine_whose_every_step_fails_stops_for_good(monkeypatch):
    engine = AsyncEngine(_core(), max_failed_steps=3)

    def broken(out):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.core.runner, "launch", broken)

    async def collect(rid):
        return [o async for o in engine.generate(Submission(PROMPTS[rid], PARAMS, rid))]

    results = await asyncio.wait_for(asyncio.gather(*(collect(rid) for rid in PROMPTS)), timeout=30)
    for outs in results:
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.ERROR
    # Steps failing one after another (requests may fail in different steps): the engine keeps
    # going until max_failed_steps steps in a row served nobody, then stops and says why.
    for _ in range(engine.max_failed_steps):
        if engine.died.is_set():
            break
        assert (await asyncio.wait_for(collect("r0"), timeout=10))[-1].finish_reason is FinishReason.ERROR
    assert engine.died.is_set() and engine.dead is not None and "3 engine steps in a row failed" in engine.dead
    with pytest.raises(EngineDeadError):
        engine.generate(Submission([1, 2, 3], PARAMS))
    await engine.stop()


async def test_requests_that_fail_alone_in_their_steps_never_stop_the_engine(monkeypatch):
    # Each poisoned request runs alone in its step, several in a row: every one of those steps
    # serves nobody, yet the device works (the probe runs), so the engine keeps serving.
    engine = AsyncEngine(_core(), max_failed_steps=2)
    real = engine.core.runner.launch

    def poisoned(out):
        if any(r.token_ids[:1] == (99,) for r in out.requests if r.num_computed_tokens == 0):
            raise RuntimeError("poisoned input")
        return real(out)

    monkeypatch.setattr(engine.core.runner, "launch", poisoned)

    async def collect(prompt, rid):
        return [o async for o in engine.generate(Submission(prompt, PARAMS, rid))]

    for i in range(5):  # alone, one after another
        outs = await asyncio.wait_for(collect([99, 1, 2], f"bad{i}"), timeout=10)
        assert outs[-1].finish_reason is FinishReason.ERROR and "poisoned" in outs[-1].error
    assert engine.dead is None and engine.core.consecutive_failed_steps == 0
    # Under load: poisoned and good requests together; the good ones finish, the bad fail.
    mixed = {f"m{i}": ([99, i, 2] if i % 2 else [1 + i, 2, 3]) for i in range(8)}
    results = await asyncio.wait_for(asyncio.gather(*(collect(p, rid) for rid, p in mixed.items())), timeout=30)
    for (rid, p), outs in zip(mixed.items(), results):
        expected = FinishReason.ERROR if p[0] == 99 else FinishReason.LENGTH
        assert outs[-1].finish_reason is expected, rid
    assert engine.dead is None
    await engine.stop()


def test_the_device_probe_tells_a_broken_device_from_a_bad_request(monkeypatch):
    core = _core()
    assert core.device_works()
    monkeypatch.setattr(core.runner, "launch", lambda out: (_ for _ in ()).throw(RuntimeError("device lost")))
    assert not core.device_works()
    core.add_request(Submission([1, 2, 3], PARAMS, request_id="x"))
    core.step()
    assert core.consecutive_failed_steps == 1  # the probe failed too: the step counts


def test_a_policy_that_fails_to_learn_from_a_step_drops_no_outputs(monkeypatch):
    core = _core(adaptive=True)

    def broken(out, seconds):
        raise RuntimeError("fit bug")

    monkeypatch.setattr(core.speculation, "observe_step", broken)
    _tokens, finals = _run(core)
    assert {o.finish_reason for o in finals.values()} == {FinishReason.LENGTH}


async def test_a_loop_that_dies_stops_the_engine_loudly_and_ends_every_stream(monkeypatch):
    engine = AsyncEngine(_core())
    real = engine.core.advance

    def commit_bug(step):
        real(step)
        raise RuntimeError("commit bug")

    def fail_all_bug(error):
        raise RuntimeError("fail_all bug")

    monkeypatch.setattr(engine.core, "advance", commit_bug)
    monkeypatch.setattr(engine.core, "fail_all", fail_all_bug)
    outs = await asyncio.wait_for(_collect_all(engine, [1, 2, 3]), timeout=10)
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.ERROR
    assert engine.died.is_set() and "engine loop died" in (engine.dead or "")
    with pytest.raises(EngineDeadError):
        engine.generate(Submission([1, 2, 3], PARAMS))
    await engine.stop()


async def _collect_all(engine, prompt):
    return [o async for o in engine.generate(Submission(prompt, PARAMS))]
