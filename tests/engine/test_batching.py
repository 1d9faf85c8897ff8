"""Continuous batching, aborts, preemption and step failures on the tiny model."""

from __future__ import annotations

import asyncio
import random

import pytest

from batchserve import AsyncEngine, FinishReason, SamplingParams
from batchserve.engine import EngineCore
from tests.conftest import TINY_VOCAB, hf_greedy, make_tiny_model, make_tiny_tokenizer, tiny_llm
from tests.engine.drafters import RandomTreeDrafter


def _core(**kwargs) -> EngineCore:
    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig

    config = EngineConfig(
        cache=CacheConfig(block_size=kwargs.pop("block_size", 4), num_blocks=kwargs.pop("num_blocks", 256)),
        scheduler=SchedulerConfig(max_num_seqs=kwargs.pop("max_num_seqs", 8), max_num_batched_tokens=256),
        draft=DraftConfig(method=kwargs.pop("draft", "llma"), decoding_length=8, adaptive=False),
    )
    return EngineCore(config, make_tiny_model(), make_tiny_tokenizer(), kwargs.pop("drafter", None))


def _assert_pool_full(core: EngineCore) -> None:
    alloc = core.scheduler.allocator
    assert not core.scheduler.requests and core.text.num_active == 0
    assert alloc.num_free_blocks == alloc.num_blocks
    core.scheduler.check_integrity()


async def test_late_request_starts_before_running_ones_finish():
    engine = AsyncEngine(_core())
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    first_token_of_late: list[float] = []
    finish_of_long: list[float] = []

    async def run(prompt, params, sink):
        async for out in engine.generate(prompt, params):
            if out.new_token_ids and sink is first_token_of_late and not sink:
                sink.append(asyncio.get_running_loop().time())
            if out.finished and sink is finish_of_long:
                sink.append(asyncio.get_running_loop().time())

    longs = [asyncio.create_task(run([1, 2, 3 + i], long, finish_of_long)) for i in range(2)]
    while engine.num_steps < 5:  # the long requests are mid-generation
        await asyncio.sleep(0.005)
    await run([9, 8, 7], SamplingParams(max_new_tokens=3), first_token_of_late)
    await asyncio.gather(*longs)
    assert first_token_of_late[0] < min(finish_of_long)
    _assert_pool_full(engine.core)
    await engine.stop()


async def test_abort_mid_stream_frees_blocks():
    engine = AsyncEngine(_core())
    got = 0
    async for out in engine.generate([5, 6, 7], SamplingParams(max_new_tokens=500, ignore_eos=True)):
        got += len(out.new_token_ids)
        assert engine.core.scheduler.allocator.num_free_blocks < engine.core.scheduler.allocator.num_blocks
        if got >= 10:
            break  # leaving the stream aborts the request
    _assert_pool_full(engine.core)

    # The documented way: leaving `async with` closes the stream.
    async with engine.generate([5, 6, 7], SamplingParams(max_new_tokens=500, ignore_eos=True)) as stream:
        async for _ in stream:
            break
    _assert_pool_full(engine.core)

    # An explicit abort ends the stream with CANCELLED.
    outs = []

    async def consume():
        async for out in engine.generate([5, 6, 7], SamplingParams(max_new_tokens=500), request_id="victim"):
            outs.append(out)

    task = asyncio.create_task(consume())
    while not outs:
        await asyncio.sleep(0.005)
    assert engine.abort("victim")
    await task
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.CANCELLED
    _assert_pool_full(engine.core)
    await engine.stop()


async def test_cancelled_consumer_task_frees_blocks():
    engine = AsyncEngine(_core())

    async def consume():
        async for _ in engine.generate([1, 2], SamplingParams(max_new_tokens=1000, ignore_eos=True)):
            pass

    task = asyncio.create_task(consume())
    while engine.num_steps < 3:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    _assert_pool_full(engine.core)
    await engine.stop()


async def test_many_concurrent_streams_match_offline(tiny_model):
    engine = AsyncEngine(_core(max_num_seqs=4))
    rng = random.Random(0)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(10)]

    async def run(p, delay):
        await asyncio.sleep(delay)
        toks = []
        async for out in engine.generate(p, SamplingParams(max_new_tokens=24)):
            toks += out.new_token_ids
        return toks

    outs = await asyncio.gather(*(run(p, 0.01 * i) for i, p in enumerate(prompts)))
    for p, toks in zip(prompts, outs):
        assert toks == hf_greedy(tiny_model, p, 24)
    _assert_pool_full(engine.core)
    await engine.stop()


def test_preemption_recomputes_and_stays_lossless(tiny_model):
    rng = random.Random(3)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(20, 40))] for _ in range(8)]
    # 8 requests of up to 40 + 40 tokens, 4-token blocks: 30 blocks hold about one and a half.
    llm = tiny_llm(RandomTreeDrafter(1, TINY_VOCAB, 16), block_size=4, num_blocks=30, max_num_seqs=8)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=40))
    assert sum(r.stats.num_preemptions for r in results) > 0
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(tiny_model, p, 40)
    _assert_pool_full(llm.engine)


def test_preemption_keeps_seeded_sampling():
    rng = random.Random(4)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(30)] for _ in range(6)]
    params = [SamplingParams(max_new_tokens=40, temperature=0.8, seed=i) for i in range(6)]
    roomy = tiny_llm(None, draft="none").generate(prompts, params)
    tight = tiny_llm(None, draft="llma", block_size=4, num_blocks=25).generate(prompts, params)
    assert sum(r.stats.num_preemptions for r in tight) > 0
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]


def test_a_transient_forward_failure_is_retried_and_nobody_fails(tiny_model, monkeypatch):
    core = _core()
    runner = core.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected kernel failure")
        return real_execute(out)

    monkeypatch.setattr(runner, "execute", flaky)
    prompts = [[1, 2, 3 + i] for i in range(3)]
    for i, p in enumerate(prompts):
        core.add_request(p, SamplingParams(max_new_tokens=20), request_id=f"a{i}")
    tokens: dict[str, list[int]] = {}
    finals = {}
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id] = o
    assert calls["n"] > 3  # the failed forward was retried in smaller groups
    assert {o.finish_reason for o in finals.values()} == {FinishReason.LENGTH}
    for i, p in enumerate(prompts):
        assert tokens[f"a{i}"] == hf_greedy(tiny_model, p, 20)
    assert core.consecutive_failed_steps == 0
    _assert_pool_full(core)


async def test_async_engine_survives_failed_step(monkeypatch):
    engine = AsyncEngine(_core())
    real_execute = engine.core.runner.execute
    state = {"fail": True}

    def flaky(out):
        if state.pop("fail", False):
            raise RuntimeError("boom")
        return real_execute(out)

    monkeypatch.setattr(engine.core.runner, "execute", flaky)
    outs = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5))]
    assert outs[-1].finish_reason is FinishReason.ERROR and "boom" in outs[-1].error
    outs = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5))]
    assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].num_output_tokens == 5
    _assert_pool_full(engine.core)
    await engine.stop()


async def test_unexpected_loop_error_ends_streams_instead_of_hanging(monkeypatch):
    engine = AsyncEngine(_core())
    real_schedule = engine.core.scheduler.schedule
    state = {"fail": True}

    def broken():
        if state.pop("fail", False):
            raise RuntimeError("scheduler bug")
        return real_schedule()

    monkeypatch.setattr(engine.core.scheduler, "schedule", broken)
    outs = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5))]
    assert outs[-1].finish_reason is FinishReason.ERROR and "scheduler bug" in outs[-1].error
    outs = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_new_tokens=5))]
    assert outs[-1].finish_reason is FinishReason.LENGTH
    _assert_pool_full(engine.core)
    await engine.stop()


def test_preemption_takes_the_youngest_by_arrival_so_nobody_thrashes(tiny_model):
    """16 requests arrive one step apart into a pool that holds a few of them. A readmitted
    request keeps its place by arrival, so the victim is always a younger one: no request is
    preempted over and over, and every output is still HF's greedy one."""
    rng = random.Random(5)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(12, 30))] for _ in range(16)]
    llm = tiny_llm(RandomTreeDrafter(2, TINY_VOCAB, 8), block_size=4, num_blocks=40, max_num_seqs=16)
    core = llm.engine
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    pending = list(prompts)
    requests, outputs = [], {}
    while pending or core.has_work():
        if pending:
            requests.append(core.add_request(pending.pop(0), params))
        for o in core.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        core.scheduler.check_integrity()
    preemptions = [r.stats.num_preemptions for r in requests]
    assert sum(preemptions) >= 8, preemptions  # the pool really was too small
    assert max(preemptions) <= 3, preemptions
    assert core.scheduler.num_preemptions == sum(preemptions)
    for p, r in zip(prompts, requests):
        assert outputs[r.request_id] == hf_greedy(tiny_model, p, 40)
    _assert_pool_full(core)


async def test_load_reports_what_admission_and_metrics_need():
    engine = AsyncEngine(_core(max_num_seqs=2, num_blocks=64))
    idle = engine.load()
    assert (idle.num_running, idle.num_waiting, idle.free_seats, idle.kv_usage) == (0, 0, 2, 0.0)
    assert idle.num_free_kv_blocks == idle.num_kv_blocks == 64
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    streams = [engine.generate([1, 2, 3, i], params) for i in range(5)]
    first = await streams[0].__anext__()  # one step has run: two admitted, three waiting
    assert not first.finished
    busy = engine.load()
    assert (busy.num_running, busy.num_waiting, busy.free_seats) == (2, 3, 0)
    assert busy.num_free_kv_blocks < 64 and busy.kv_usage == pytest.approx(1 - busy.num_free_kv_blocks / 64)
    for s in streams:
        async for _ in s:
            pass
    done = engine.load()
    assert (done.num_running, done.num_waiting, done.num_free_kv_blocks) == (0, 0, 64)
    await engine.stop()
