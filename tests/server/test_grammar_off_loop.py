"""Structured output off the event loop: a constraint compiles (llguidance builds its parser) in
the front end's grammar thread, once per constraint text, and each request's matcher is a copy
of the compiled one; the loop (every other stream, the step loop) never waits on a parser."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from batchserve.grammar import GrammarCompiler
from batchserve.request import Constraint
from batchserve.server.client import build_request

PROMPT = [72, 101, 108, 108, 111]
BUILD_SECONDS = 0.6  # what the stand-in parser takes; a large schema's real one takes 50-100 ms


class _SlowMatcher:
    """llguidance.LLMatcher whose construction takes BUILD_SECONDS without the GIL (as llguidance
    builds its parser), recording the threads it ran on."""

    def __init__(self, real: type) -> None:
        self.real, self.threads = real, []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread())
        time.sleep(BUILD_SECONDS)
        return self.real(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


@pytest.fixture
def slow_builds(monkeypatch: pytest.MonkeyPatch) -> tuple[_SlowMatcher, list[threading.Thread]]:
    import llguidance

    spy = _SlowMatcher(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", spy)
    copies: list[threading.Thread] = []
    matcher = GrammarCompiler.matcher

    def recorded(self: GrammarCompiler, compiled):  # type: ignore[no-untyped-def]
        copies.append(threading.current_thread())
        return matcher(self, compiled)

    monkeypatch.setattr(GrammarCompiler, "matcher", recorded)
    return spy, copies


async def _ticks(stop: asyncio.Event, gaps: list[float]) -> None:
    """The loop's stalls: how late each 5 ms sleep wakes up."""
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.005)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def test_constraints_compile_off_the_loop_once_and_never_stall_it(running, slow_builds):
    builds, copies = slow_builds
    properties = {f"field_{i}": {"type": "integer"} for i in range(40)}
    schema = json.dumps({"type": "object", "properties": properties, "required": ["field_0"]})
    gaps: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.ensure_future(_ticks(stop, gaps))
    requests = [build_request(PROMPT, max_new_tokens=6, constraint=Constraint("json_schema", schema)) for _ in range(2)]
    plain = build_request(PROMPT, max_new_tokens=24, ignore_eos=True)
    replies = await asyncio.gather(*(running.stub.Generate(r) for r in [*requests, plain]))
    stop.set()
    await ticker
    assert all(r.token_ids for r in replies)
    loop_thread = threading.current_thread()
    # One parser for the two requests (the second is a cache hit), built in a thread of its own;
    # each request got its copy of it.
    assert len(builds.threads) == 1 and builds.threads[0] is not loop_thread and len(copies) == 2
    # The loop kept running while the parser was built: no stall near the build's length (on the
    # loop it would stall every stream for all of it).
    assert max(gaps) < BUILD_SECONDS / 2, max(gaps)


async def test_a_bad_constraint_is_still_refused_before_the_request_is_queued(running):
    import grpc

    req = build_request(PROMPT, max_new_tokens=6, constraint=Constraint("regex", "[0-9"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Generate(req)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "unclosed character class" in e.value.details()
    assert not running.core.has_work()
