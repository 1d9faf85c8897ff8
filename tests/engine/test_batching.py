"""Continuous batching, aborts, preemption and step failures on the tiny model."""

from __future__ import annotations

import asyncio
import logging
import random
import threading

import pytest

from batchserve import AsyncEngine, FinishReason, SamplingParams
from batchserve.admission import Submission
from batchserve.engine import EngineCore
from tests.conftest import TINY_VOCAB, hf_greedy, make_tiny_model, make_tiny_tokenizer, tiny_llm
from tests.engine.drafters import RandomTreeDrafter, WrongChainDrafter


def _core(**kwargs) -> EngineCore:
    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig

    config = EngineConfig(
        cache=CacheConfig(block_size=kwargs.pop("block_size", 4), num_blocks=kwargs.pop("num_blocks", 256)),
        scheduler=SchedulerConfig(max_num_seqs=kwargs.pop("max_num_seqs", 8), max_num_batched_tokens=256),
        draft=DraftConfig(
            method=kwargs.pop("draft", "llma"), decoding_length=kwargs.pop("decoding_length", 8), adaptive=False
        ),
    )
    return EngineCore(config, make_tiny_model(), make_tiny_tokenizer(), kwargs.pop("drafter", None))


def _assert_pool_full(core: EngineCore) -> None:
    alloc = core.scheduler.allocator
    assert not core.scheduler.requests and core.detok.num_active == 0
    assert alloc.num_free_blocks == alloc.num_blocks
    core.scheduler.check_integrity()


async def test_late_request_starts_before_running_ones_finish():
    engine = AsyncEngine(_core())
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    first_token_of_late: list[float] = []
    finish_of_long: list[float] = []

    async def run(prompt, params, sink):
        async for out in engine.generate(Submission(prompt, params)):
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
    async for out in engine.generate(Submission([5, 6, 7], SamplingParams(max_new_tokens=500, ignore_eos=True))):
        got += len(out.new_token_ids)
        assert engine.core.scheduler.allocator.num_free_blocks < engine.core.scheduler.allocator.num_blocks
        if got >= 10:
            break  # leaving the stream aborts the request
    _assert_pool_full(engine.core)

    # The documented way: leaving `async with` closes the stream.
    async with engine.generate(Submission([5, 6, 7], SamplingParams(max_new_tokens=500, ignore_eos=True))) as stream:
        async for _ in stream:
            break
    _assert_pool_full(engine.core)

    # An explicit abort ends the stream with CANCELLED.
    outs = []

    async def consume():
        async for out in engine.generate(
            Submission([5, 6, 7], SamplingParams(max_new_tokens=500), request_id="victim")
        ):
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
        async for _ in engine.generate(Submission([1, 2], SamplingParams(max_new_tokens=1000, ignore_eos=True))):
            pass

    task = asyncio.create_task(consume())
    while engine.num_steps < 3:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    _assert_pool_full(engine.core)
    await engine.stop()


@pytest.mark.parametrize("beside", [False, True])
async def test_many_concurrent_streams_match_offline(tiny_model, beside):
    """`beside`: the next step goes to the worker before the front ends stream (a GPU's order)."""
    engine = AsyncEngine(_core(max_num_seqs=4))
    assert engine.stream_beside_forward is False  # on a CPU the front ends go first
    engine.stream_beside_forward = beside
    rng = random.Random(0)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(10)]

    async def run(p, delay):
        await asyncio.sleep(delay)
        toks = []
        async for out in engine.generate(Submission(p, SamplingParams(max_new_tokens=24))):
            toks += out.new_token_ids
        return toks

    outs = await asyncio.gather(*(run(p, 0.01 * i) for i, p in enumerate(prompts)))
    for p, toks in zip(prompts, outs):
        assert toks == hf_greedy(tiny_model, p, 24)
    _assert_pool_full(engine.core)
    await engine.stop()


def _recomputes(core: EngineCore) -> list[tuple[str, int]]:
    """Collects (request id, chunk length) for every step chunk that starts from no K/V."""
    fresh: list[tuple[str, int]] = []
    core.step_listeners.append(
        lambda out, phases: fresh.extend(
            (i.request_id, len(i.token_ids)) for i in out.requests if not i.num_computed_tokens
        )
    )
    return fresh


def test_preemption_recomputes_and_stays_lossless(tiny_model):
    rng = random.Random(3)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(20, 40))] for _ in range(8)]
    # 8 requests of up to 40 + 40 tokens, 4-token blocks: 30 blocks hold about one and a half.
    # Without the prefix cache: a readmitted request recomputes everything (cached: test_prefix_cache.py).
    llm = tiny_llm(
        RandomTreeDrafter(1, TINY_VOCAB, 16), block_size=4, num_blocks=30, max_num_seqs=8, prefix_caching=False
    )
    fresh = _recomputes(llm.engine)
    results = llm.generate(prompts, SamplingParams(max_new_tokens=40))
    # Real preemptions (a running request sent back), not requests merely waiting for blocks.
    preemptions = {r.request_id: r.stats.num_preemptions for r in results}
    assert sum(preemptions.values()) > 0
    assert llm.engine.scheduler.num_preemptions == sum(preemptions.values())
    # Each one dropped the request's K/V: it came back as one chunk from position 0 holding its
    # prompt and the output it had (its first admission is the bare prompt).
    prompt_len = {r.request_id: len(r.prompt_token_ids) for r in results}
    admissions = {rid: [n for i, n in fresh if i == rid] for rid in prompt_len}
    for rid, chunks in admissions.items():
        assert chunks[0] == prompt_len[rid]
        assert len(chunks) == 1 + preemptions[rid], (rid, chunks)
        assert all(n > prompt_len[rid] for n in chunks[1:]), (rid, chunks)
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(tiny_model, p, 40)
    _assert_pool_full(llm.engine)


def test_preemption_keeps_seeded_sampling():
    rng = random.Random(4)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(30)] for _ in range(6)]
    params = [SamplingParams(max_new_tokens=40, temperature=0.8, seed=i) for i in range(6)]
    roomy = tiny_llm(None, draft="none").generate(prompts, params)
    small = tiny_llm(None, draft="llma", block_size=4, num_blocks=25, prefix_caching=False)
    fresh = _recomputes(small.engine)
    tight = small.generate(prompts, params)
    preempted = {r.request_id for r in tight if r.stats.num_preemptions}
    assert preempted  # running requests really were sent back, not just kept waiting
    assert small.engine.scheduler.num_preemptions == sum(r.stats.num_preemptions for r in tight)
    # and recomputed what they had sampled (their draws must not be redone differently)
    assert {rid for rid, n in fresh if n > 30} == preempted
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]


def test_a_transient_forward_failure_is_retried_and_nobody_fails(tiny_model, monkeypatch):
    core = _core()
    runner = core.runner
    real_execute = runner.launch
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected kernel failure")
        return real_execute(out)

    monkeypatch.setattr(runner, "launch", flaky)
    prompts = [[1, 2, 3 + i] for i in range(3)]
    for i, p in enumerate(prompts):
        core.add_request(Submission(p, SamplingParams(max_new_tokens=20), request_id=f"a{i}"))
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
    real_execute = engine.core.runner.launch
    state = {"fail": True}

    def flaky(out):
        if state.pop("fail", False):
            raise RuntimeError("boom")
        return real_execute(out)

    monkeypatch.setattr(engine.core.runner, "launch", flaky)
    outs = [o async for o in engine.generate(Submission([1, 2, 3], SamplingParams(max_new_tokens=5)))]
    assert outs[-1].finish_reason is FinishReason.ERROR and "boom" in outs[-1].error
    outs = [o async for o in engine.generate(Submission([1, 2, 3], SamplingParams(max_new_tokens=5)))]
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
    outs = [o async for o in engine.generate(Submission([1, 2, 3], SamplingParams(max_new_tokens=5)))]
    assert outs[-1].finish_reason is FinishReason.ERROR and "scheduler bug" in outs[-1].error
    outs = [o async for o in engine.generate(Submission([1, 2, 3], SamplingParams(max_new_tokens=5)))]
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
            requests.append(core.add_request(Submission(pending.pop(0), params)))
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
    streams = [engine.generate(Submission([1, 2, 3, i], params)) for i in range(5)]
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


def test_draft_dropped_for_lack_of_blocks_before_anyone_is_preempted(tiny_model):
    """Two running requests in a pool that holds both their roots but not the older one's
    tree: that tree is left out of the step (its request decodes without it) and nobody is
    preempted to make room for speculation, not even the younger request."""
    prompts = [[3, 1, 4, 1], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5]]
    lengths = [28, 4]  # max_new_tokens: the older ends at 32 tokens, the younger at 20
    truth = {tuple(p): hf_greedy(tiny_model, p, n, ignore_eos=True) for p, n in zip(prompts, lengths)}
    drafter = WrongChainDrafter(truth, TINY_VOCAB)  # every tree rejected: one token per step
    # 8 blocks of 4 slots hold both requests' roots to the end (at most 2 + 5 blocks while
    # both run, then 8 for the older alone), but from the second step on not the older one's
    # 8-token tree beside the younger one's root.
    core = _core(block_size=4, num_blocks=8, decoding_length=8, drafter=drafter)
    steps, problems = [], []

    def listen(out, phases):  # (a listener's exceptions are logged, not raised: collect them)
        block_size = core.scheduler.allocator.block_size
        proposed = {rid for rid, _ in drafter.proposed}
        drafter.proposed.clear()
        for item in out.requests:
            slots = item.num_computed_tokens + len(item.token_ids) + (len(item.draft) if item.draft else 0)
            if len(item.block_ids) * block_size < slots:  # an attached tree always has its KV slots
                problems.append(item)
        steps.append({i.request_id: (i.request_id in proposed, i.draft is not None) for i in out.requests})

    core.step_listeners.append(listen)
    reqs = [
        core.add_request(Submission(p, SamplingParams(max_new_tokens=n, ignore_eos=True)))
        for p, n in zip(prompts, lengths)
    ]
    while core.has_work():
        core.step()
        assert core.scheduler.num_preemptions == 0
        assert all(r.is_finished or r in core.scheduler.running for r in reqs)  # nobody sent back to wait
        core.scheduler.check_integrity()
    assert not problems
    old, young = (r.request_id for r in reqs)
    # A step that ran both requests in which the older one's proposed tree was left out...
    dropped = [s for s in steps if young in s and s.get(old) == (True, False)]
    assert dropped, steps
    # ...while the younger kept its own tree (it fits): the step had blocks, just not enough.
    assert any(s[young] == (True, True) for s in dropped), steps
    assert [r.stats.num_preemptions for r in reqs] == [0, 0]
    assert [r.finish_reason for r in reqs] == [FinishReason.LENGTH] * 2
    for p, r in zip(prompts, reqs):
        assert r.output_token_ids == truth[tuple(p)]
    _assert_pool_full(core)


@pytest.mark.parametrize("how", ["abort", "cancel"])
async def test_abort_landing_while_the_forward_runs_in_the_worker_thread(tiny_model, monkeypatch, caplog, how):
    """The forward is held in the worker thread while one of its two requests is aborted
    (engine.abort, or its consumer task cancelled as when a client goes away): that request
    gets nothing from the step, the other finishes losslessly, every block comes back."""
    caplog.set_level(logging.WARNING, logger="batchserve")
    engine = AsyncEngine(_core(num_blocks=64))
    core = engine.core
    real_execute = core.runner.launch
    inside, release = threading.Event(), threading.Event()
    held = []

    def gated(out):  # runs in the worker thread
        if not held and len(out.requests) == 2 and all(r.sample for r in out.requests) and core.num_steps >= 3:
            held.append(out)
            inside.set()
            assert release.wait(timeout=60)
        return real_execute(out)

    monkeypatch.setattr(core.runner, "launch", gated)
    prompts = {"victim": [5, 6, 7, 8], "keeper": [9, 10, 11]}
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    outs: dict[str, list] = {"victim": [], "keeper": []}

    async def consume(rid):
        async for out in engine.generate(Submission(prompts[rid], params, request_id=rid)):
            outs[rid].append(out)

    tasks = {rid: asyncio.create_task(consume(rid)) for rid in prompts}
    try:
        while not inside.is_set():
            await asyncio.sleep(0.002)
        # The forward is running now; the victim is in it.
        assert {r.request_id for r in held[0].requests} == {"victim", "keeper"}
        victim = core.scheduler.requests["victim"]
        tokens_before = list(victim.output_token_ids)
        assert tokens_before  # it had streamed some tokens already
        if how == "abort":
            assert engine.abort("victim")
        else:
            tasks["victim"].cancel()
            await asyncio.sleep(0)  # the cancelled consumer closes its stream
        assert "victim" not in core.scheduler.requests and victim.is_finished
    finally:
        release.set()  # never leave the worker thread waiting
    await tasks["keeper"]
    if how == "abort":
        await tasks["victim"]
        assert outs["victim"][-1].finished and outs["victim"][-1].finish_reason is FinishReason.CANCELLED
        assert outs["victim"][-1].new_token_ids == []
    else:
        with pytest.raises(asyncio.CancelledError):
            await tasks["victim"]
    # Nothing from the held step (or later) reached the victim or its stream.
    assert victim.output_token_ids == tokens_before
    assert [t for o in outs["victim"] for t in o.new_token_ids] == tokens_before
    assert victim.finish_reason is FinishReason.CANCELLED and not victim.block_ids
    assert tokens_before == hf_greedy(tiny_model, prompts["victim"], 40)[: len(tokens_before)]
    keeper = [t for o in outs["keeper"] for t in o.new_token_ids]
    assert outs["keeper"][-1].finish_reason is FinishReason.LENGTH
    assert keeper == hf_greedy(tiny_model, prompts["keeper"], 40)
    # The loop went on without an error, and the pool is whole.
    assert engine.dead is None and core.consecutive_failed_steps == 0
    assert engine._task is not None and not engine._task.done()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    _assert_pool_full(core)
    await engine.stop()


async def test_a_built_engine_does_all_its_torch_work_in_its_step_thread(monkeypatch):
    """AsyncEngine.build makes the core in the step thread: one thread then runs every OpenMP
    region of the process (a second one's worker pool makes libgomp stop spinning between
    regions on a small machine: every step slower), and its steps run there too."""
    import batchserve.async_engine as async_engine
    from batchserve.config import EngineConfig

    threads: list[str] = []

    class Recording(EngineCore):
        def __init__(self, *args, **kwargs) -> None:
            threads.append(threading.current_thread().name)
            super().__init__(*args, **kwargs)

        def execute(self, step) -> None:
            threads.append(threading.current_thread().name)
            super().execute(step)

    monkeypatch.setattr(async_engine, "EngineCore", Recording)
    engine = AsyncEngine.build(EngineConfig(), make_tiny_model(), make_tiny_tokenizer())
    out = [o async for o in engine.generate(Submission([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True)))]
    assert out[-1].finished and len(threads) >= 2
    assert len(set(threads)) == 1 and threads[0].startswith("batchserve-step")
    await engine.stop()
    with pytest.raises(ValueError, match="max_num_seqs"):  # a bad config fails the build, the thread is released
        AsyncEngine.build(EngineConfig().with_settings(max_num_seqs=0), make_tiny_model(), make_tiny_tokenizer())
