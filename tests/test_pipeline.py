"""The pipelined loop (a step's outputs built while the next step's forward runs) gives the same
outputs as the sequential loop, step for step: greedy and seeded, stop strings, aborts,
preemption, resumed requests, structured output, and failures met while building outputs."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pytest

from batchserve import AsyncEngine, FinishReason, SamplingParams
from batchserve.admission import Submission
from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig
from batchserve.engine import EngineCore
from batchserve.request import Constraint, RequestOutput
from batchserve.serving_loop import StepPipeline
from tests.conftest import TINY_VOCAB, make_ascii_model, make_tiny_tokenizer
from tests.engine.drafters import RandomTreeDrafter

PROMPTS = [[72, 101, 108, 108, 111], [100, 101, 102, 32, 102], [40, 41, 42], [97, 98, 99, 100, 101, 102, 103, 104]]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _core(num_blocks: int = 256, adaptive: bool = False, drafter: Any = None) -> EngineCore:
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        draft=DraftConfig(decoding_length=6, adaptive=adaptive, learn_step_costs=False),
    )
    if adaptive:
        from tests.speculation.workloads import gpu_like

        return EngineCore(config, make_ascii_model(), make_tiny_tokenizer(), drafter, cost_profile=gpu_like(cdl=16))
    drafter = drafter or RandomTreeDrafter(3, TINY_VOCAB, 6)
    return EngineCore(config, make_ascii_model(), make_tiny_tokenizer(), drafter)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=24, ignore_eos=True),
        SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_new_tokens=40, stop=("zz", "j)"), ignore_eos=True),  # r2 writes "hj)" at its 16th token
        SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=2),
    ]


def _output(o: RequestOutput) -> tuple:
    return (o.request_id, tuple(o.new_token_ids), o.new_text, o.finished, o.finish_reason, o.error, o.new_logprobs)


def _drive(core: EngineCore, pipelined: bool, params: list[SamplingParams], abort_at: dict[int, str]) -> list[tuple]:
    """Every output of a run, in order; `abort_at`: after that many steps, abort that request."""
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        core.add_request(Submission(p, sp, request_id=f"r{i}"))
    pipe = StepPipeline(core)
    seen: list[tuple] = []
    n = 0
    while pipe.has_work() if pipelined else core.has_work():
        outs = pipe.step() if pipelined else core.step()
        n += 1
        if n in abort_at:
            rid = abort_at[n]
            outs += pipe.abort(rid) if pipelined else ([core.abort(rid)] if core.has_work() else [])
        seen += [_output(o) for o in outs if o is not None]
    assert core.detok.num_active == 0 and not core.scheduler.requests
    pool = core.scheduler.allocator
    assert pool.num_free_blocks == pool.num_blocks
    return seen


@pytest.mark.parametrize(
    "case",
    ["plain", "abort", "preemption", "resumed", "structured"],
)
def test_the_pipelined_loop_gives_the_sequential_loops_outputs_step_for_step(case: str) -> None:
    params, abort_at, blocks = _params(), {}, 256
    if case == "abort":
        abort_at = {4: "r1", 7: "r3"}
    elif case == "preemption":
        blocks = 16  # four requests of up to 48 slots in 64: some are preempted and recomputed
    elif case == "resumed":
        params[0] = replace(params[0], resume_token_ids=(104, 105, 32, 116))
        params[1] = replace(params[1], resume_token_ids=(120,))
    elif case == "structured":
        params[2] = SamplingParams(max_new_tokens=40, constraint=Constraint("json_schema", json.dumps(SCHEMA)))
        regex = Constraint("regex", "[a-c]+!")
        params[3] = SamplingParams(max_new_tokens=30, temperature=0.7, seed=3, constraint=regex)
    core = _core(blocks)
    sequential = _drive(core, False, params, abort_at)
    preempted = {"n": core.scheduler.num_preemptions}
    pipelined = _drive(_core(blocks), True, params, abort_at)
    assert pipelined == sequential
    finals = {o[0]: o for o in sequential if o[3]}
    assert len(finals) == 4  # every request got its final output, exactly once
    assert sum(o[3] for o in sequential) == 4
    if case == "preemption":
        assert preempted["n"] > 0
    if case == "abort":
        assert finals["r1"][4] is FinishReason.CANCELLED and finals["r3"][4] is FinishReason.CANCELLED
    if case == "plain":
        assert finals["r2"][4] is FinishReason.STOP_SEQUENCE and "".join(o[2] for o in sequential if o[0] == "r2")


def test_with_the_adaptive_policy_the_tokens_and_texts_are_the_same() -> None:
    # The policy's drafts may differ once its trackers see a step later, never the tokens.
    def texts(pipelined: bool) -> dict[str, tuple[list[int], str, Any]]:
        out: dict[str, tuple[list[int], str, Any]] = {}
        for rid, toks, text, finished, reason, _, _ in _drive(_core(adaptive=True), pipelined, _params(), {}):
            prev = out.get(rid, ([], "", None))
            out[rid] = (prev[0] + list(toks), prev[1] + text, reason if finished else None)
        return out

    assert texts(True) == texts(False)


def test_a_request_whose_schedule_fails_gets_its_final_output(monkeypatch) -> None:
    core = _core()
    params = [replace(sp, constraint=None) for sp in _params()]
    params[0] = SamplingParams(max_new_tokens=40, constraint=Constraint("regex", "[a-z]+"))
    real = core.scheduler.grammar.row_masks
    calls = {"n": 0}

    def broken(req, tree):
        calls["n"] += 1
        if calls["n"] == 3:
            core.scheduler.grammar.failed[req.request_id] = "structured output failed: injected"
            return None
        return real(req, tree)

    monkeypatch.setattr(core.scheduler.grammar, "row_masks", broken)
    seen = _drive(core, True, params, {})
    final = [o for o in seen if o[0] == "r0" and o[3]]
    assert len(final) == 1 and final[0][4] is FinishReason.CONSTRAINT_FAILED and "injected" in final[0][5]


async def test_the_async_engine_streams_beside_the_forward_with_the_same_outputs() -> None:
    async def run(beside: bool) -> dict[str, list[tuple]]:
        engine = AsyncEngine(_core())
        engine.stream_beside_forward = beside
        streams = [
            engine.generate(Submission(p, sp, request_id=f"r{i}")) for i, (p, sp) in enumerate(zip(PROMPTS, _params()))
        ]

        async def read(stream: Any) -> list[tuple]:
            return [_output(o)[1:] for o in [o async for o in stream]]

        outs = await asyncio.gather(*(read(s) for s in streams))
        await engine.stop()
        return {f"r{i}": o for i, o in enumerate(outs)}

    def joined(runs: dict[str, list[tuple]]) -> dict[str, tuple[list[int], str]]:
        return {rid: ([t for o in outs for t in o[0]], "".join(o[1] for o in outs)) for rid, outs in runs.items()}

    beside, after = await run(True), await run(False)
    assert joined(beside) == joined(after)
    assert all(outs[-1][2] for outs in beside.values())


async def test_on_a_device_one_thread_launches_and_collects_and_outputs_are_built_between() -> None:
    # The step thread launches, then sits idle while the loop thread builds the last step's
    # outputs (nothing competes with the launch for the GIL), then collects.
    import threading

    core = _core()
    engine = AsyncEngine(core)
    engine.stream_beside_forward = True
    calls: list[tuple[str, str]] = []
    for name in ("launch", "collect", "finish"):
        real = getattr(core, name)

        def traced(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append((_name, threading.current_thread().name))
            return _real(*args)

        setattr(core, name, traced)
    streams = [engine.generate(Submission(p, sp)) for p, sp in zip(PROMPTS, _params())]
    for s in streams:
        assert [o async for o in s][-1].finished
    await engine.stop()
    loop_thread = threading.current_thread().name
    threads = {name: {t for n, t in calls if n == name} for name in ("launch", "collect", "finish")}
    assert len(threads["launch"]) == 1 and threads["launch"] == threads["collect"] != {loop_thread}
    assert threads["finish"] == {loop_thread}
    order = [n for n, _ in calls]
    starts = [i for i, n in enumerate(order) if n == "launch"]
    assert len(starts) > 3
    for i in starts[1:]:  # every later step: launch, the last step's outputs, then collect
        assert order[i : i + 3] == ["launch", "finish", "collect"]


@pytest.mark.parametrize("beside", [False, True])
def test_llm_runs_the_loop_that_serves_with_the_sequential_loops_outputs(beside: bool, monkeypatch) -> None:
    from batchserve import LLM

    monkeypatch.setattr(EngineCore, "outputs_beside_forward", property(lambda self: beside))
    core = _core()
    llm = LLM.from_core(core)
    assert llm.loop.beside_forward is beside
    assert core.speculation.judged_in_series is not beside  # judging in series delays the next step
    served = llm.generate(PROMPTS, _params())
    expected = _drive(_core(), False, _params(), {})
    assert [r.token_ids for r in served] == [
        [t for o in expected if o[0] == f"r{i}" for t in o[1]] for i in range(len(PROMPTS))
    ]
    assert [r.text for r in served] == ["".join(o[2] for o in expected if o[0] == f"r{i}") for i in range(len(PROMPTS))]
    assert not llm.loop.has_work() and core.detok.num_active == 0
