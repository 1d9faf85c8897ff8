"""Bounded inputs on a real server: nothing a client sends stalls others or disturbs their requests."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from batchserve.server.client import build_request
from batchserve.v1 import generation_pb2 as pb
from tests.server.conftest import start_server, tiny_core


async def _collect(call) -> list:
    chunks = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    return chunks


async def test_a_message_over_the_limit_is_refused_by_size(running):
    limit = running.server.max_message_bytes
    assert limit < 2**20  # sized to the tiny model's 1024-token context, not 64 MiB
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Generate(build_request("a" * (limit + 1), max_new_tokens=1))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await running.stub.Generate(build_request([1, 2], max_new_tokens=2))).usage.completion_tokens == 2


async def test_tokenizing_never_stalls_other_streams(running, monkeypatch):
    core = running.core
    real = core.text.tokenize

    def slow(prompt, *field):
        time.sleep(1.0)  # a huge input's tokenization, in the tokenizer thread
        return real(prompt, *field)

    monkeypatch.setattr(core.text, "tokenize", slow)
    stream = running.stub.StreamGenerate(build_request([1, 2, 3], max_new_tokens=400, ignore_eos=True))
    await stream.read()
    arrivals: list[float] = []

    async def read_chunks() -> None:
        while (await stream.read()) is not grpc.aio.EOF:
            arrivals.append(time.monotonic())

    reader = asyncio.create_task(read_chunks())
    started = time.monotonic()
    slow_call = await running.stub.Generate(build_request("hello", max_new_tokens=2))
    ended = time.monotonic()
    # Timing, so bounds: the call cannot end before its 1 s tokenization; how many chunks the
    # stream gets meanwhile depends on the machine (many here; none if the loop stalled).
    assert slow_call.usage.completion_tokens == 2 and ended - started >= 1.0
    # While the slow input was being tokenized, the running stream kept getting chunks.
    assert sum(started < t < started + 1.0 for t in arrivals) >= 3, arrivals[:10]
    await reader


async def test_a_live_request_id_cannot_be_reused_or_disturbed(running):
    first = running.stub.StreamGenerate(build_request([1, 2, 3], request_id="job-1", max_new_tokens=60))
    await first.read()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Generate(build_request([4, 5], request_id="job-1", max_new_tokens=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
    rest = await _collect(first)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == 60
    # Once it is done, the id is free again.
    again = await running.stub.Generate(build_request([4, 5], request_id="job-1", max_new_tokens=5))
    assert again.request_id == "job-1" and again.usage.completion_tokens == 5


async def test_request_ids_are_per_tenant_so_none_can_be_probed_or_taken(running):
    """Another tenant's live id is invisible: the same id from a second tenant runs beside it
    (no "already in use" that would confirm it), and both answers carry the id each client chose."""
    first = running.stub.StreamGenerate(
        build_request([1, 2, 3], request_id="job-7", max_new_tokens=40), metadata=(("x-batchserve-tenant", "a"),)
    )
    await first.read()
    other = await running.stub.Generate(
        build_request([4, 5], request_id="job-7", max_new_tokens=5), metadata=(("x-batchserve-tenant", "b"),)
    )
    assert other.request_id == "job-7" and other.usage.completion_tokens == 5
    with pytest.raises(grpc.aio.AioRpcError) as e:  # the same tenant's own id is still taken
        await running.stub.Generate(
            build_request([4, 5], request_id="job-7", max_new_tokens=5), metadata=(("x-batchserve-tenant", "a"),)
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    rest = await _collect(first)
    assert {c.request_id for c in rest} == {"job-7"} and rest[-1].usage.completion_tokens == 40


async def test_a_tiny_temperature_is_greedy(running):
    greedy = await running.stub.Generate(build_request([7, 8, 9], max_new_tokens=12))
    tiny = await running.stub.Generate(build_request([7, 8, 9], max_new_tokens=12, temperature=1e-38, seed=1))
    assert list(tiny.token_ids) == list(greedy.token_ids)


async def test_a_chat_template_error_is_invalid_argument():
    core = tiny_core()
    core.tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    )
    running = await start_server(core)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await running.stub.Generate(build_request([{"role": "system", "content": "hi"}], max_new_tokens=2))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no system role" in e.value.details()
    finally:
        await running.channel.close()
        await running.server.shutdown()


async def test_a_burst_within_free_seats_plus_the_queue_is_admitted():
    # 8 seats, a queue of 16: a burst of 20 is 8 running next step and 12 waiting: none refused.
    running = await start_server(tiny_core(max_num_seqs=8), max_waiting_requests=16)
    try:
        calls = [running.stub.Generate(build_request([1 + i, 2], max_new_tokens=8)) for i in range(20)]
        results = await asyncio.gather(*calls)
        assert all(r.usage.completion_tokens == 8 for r in results)
    finally:
        await running.channel.close()
        await running.server.shutdown()


async def test_tokenize_is_refused_while_draining_and_capped(running):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Tokenize(pb.TokenizeRequest(text="a" * 40_000))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input.text" in e.value.details()
    running.server.frontend.draining = True
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Tokenize(pb.TokenizeRequest(text="hi"))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_the_tenant_comes_from_the_metadata_by_default_and_is_validated(running):
    # By default only the x-batchserve-tenant metadata (what a gateway sets) names the tenant:
    # the request's own field cannot pick another tenant's scope (tests/server/test_trust.py has
    # the other sources).
    drafter = running.core.speculation.drafter
    await running.stub.Generate(build_request([1, 2, 3], max_new_tokens=6), metadata=(("x-batchserve-tenant", "acme"),))
    assert set(drafter.stats()["scopes"]) == {"acme"}
    await running.stub.Generate(
        build_request([1, 2, 3], max_new_tokens=6, tenant="zeta"), metadata=(("x-batchserve-tenant", "acme"),)
    )
    assert set(drafter.stats()["scopes"]) == {"acme"}  # the field is not a key under tenant_source=header
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Generate(
            build_request([1, 2, 3], max_new_tokens=6), metadata=(("x-batchserve-tenant", "no spaces"),)
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant" in e.value.details()
