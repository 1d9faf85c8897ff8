"""One request's walk through the house enters each room from at most two others (`tests/walk.py`).

The walk is traced on every thread from the call to its answer: a gRPC Generate and an HTTP
chat completion, each with lookahead drafts, a stop string, logprobs and a structured-output
constraint, on the tiny model. A room entered from a third room is a request's path that a
reader must follow back and forth; the report names every door.

One room has three by design: structured output (`grammar/`) is built at admission (its
constraint compiled, the request's matcher copied and, for a resumed request, advanced), drafted
around by speculation (forced tokens, drafts pruned before the policy sizes them) and committed
by the scheduler (each token advances the matcher, whose end is a stop)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from batchserve.admission import Submission
from batchserve.request import Constraint, Request
from batchserve.server.client import build_request
from batchserve.text import TokenIds
from tests.server.conftest import Running, start_server
from tests.walk import Walk

MOST_DOORS = 2
DOORS = {"grammar": 3}  # see above
PROMPT = "one two three four one two three four one two three four"


@pytest.fixture(scope="module")
def walk() -> Iterator[Walk]:
    traced = Walk()
    traced.install()  # before the server: its threads are traced too
    yield traced
    traced.uninstall()


def _check(walk: Walk, what: str) -> None:
    crowded = {room: doors for room, doors in walk.entries().items() if len(doors) > DOORS.get(room, MOST_DOORS)}
    assert not crowded, f"{what}: rooms entered from more than {MOST_DOORS} others\n{walk.report()}"
    assert walk.entries()["grammar"] == {"admission", "speculation", "scheduler"}, walk.report()
    assert {"server", "engine", "scheduler", "speculation", "runner", "detokenize", "grammar"} <= set(walk.entries()), (
        walk.report()
    )  # the walk saw the whole request, drafts, stop strings and grammar included


async def _traced(walk: Walk, r: Running, call) -> None:
    """`call` once to warm (grammars compiled, objects built lazily), then once traced. Each
    request reaches the engine as one record whose prompt ids were checked and whose grammar was
    compiled off the loop, once: admission neither checks an id again nor compiles."""
    subs: list[Submission] = []
    real = r.core.add_request

    def spy(sub: Submission) -> Request:
        subs.append(sub)
        return real(sub)

    r.core.add_request = spy  # type: ignore[method-assign]
    await call()
    walk.start()
    try:
        await call()
    finally:
        walk.stop()
    assert subs and all(isinstance(s.prompt, TokenIds) and s.grammar is not None for s in subs), subs


def test_a_grpc_request_enters_each_room_from_at_most_two(walk: Walk) -> None:
    async def run() -> None:
        r: Running = await start_server()
        try:
            grammar = Constraint("regex", "[a-z ]{0,40}")
            req = build_request(PROMPT, max_new_tokens=16, stop=["zz"], constraint=grammar, logprobs=1)
            await _traced(walk, r, lambda: r.stub.Generate(req))
        finally:
            await r.channel.close()
            await r.server.shutdown()

    asyncio.run(run())
    _check(walk, "gRPC Generate")


def test_an_http_chat_request_enters_each_room_from_at_most_two(walk: Walk) -> None:
    async def run() -> None:
        r: Running = await start_server(http=True)
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 16,
            "stop": ["zz"],
            "logprobs": True,
            "response_format": {"type": "json_object"},
        }
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{r.server.http_port}") as client:

                async def call() -> None:
                    reply = await client.post("/v1/chat/completions", json=body)
                    assert reply.status_code == 200, reply.text

                await _traced(walk, r, call)
        finally:
            await r.channel.close()
            await r.server.shutdown()

    asyncio.run(run())
    _check(walk, "HTTP chat completion")
