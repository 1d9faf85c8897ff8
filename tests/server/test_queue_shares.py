"""The waiting queue per tenant: with the queue full, a tenant within its share takes the places of
the youngest never-started calls of a tenant over its share, which end refused (RESOURCE_EXHAUSTED,
HTTP 429); a tenant over its share is refused itself; a per-tenant cap holds at any load."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from batchserve.server.client import build_request
from batchserve.server.queue_shares import TenantQueues
from tests.server.conftest import start_server, tiny_core


def _as(tenant: str) -> tuple[tuple[str, str]]:
    return (("x-batchserve-tenant", tenant),)


def test_a_tenant_over_its_share_gives_its_youngest_waiting_calls() -> None:
    q = TenantQueues(limit=6)
    calls = [q.hold("flood", 2) for _ in range(3)]
    for i, call in enumerate(calls):
        call.request_ids = [f"f{i}a", f"f{i}b"]
    started = {"f2b"}  # one of the youngest call's samples already ran: that call stays
    assert q.share("other") == 3.0
    victims = q.displaceable("other", 1, 1, lambda rid: rid not in started)
    assert victims == [calls[1]]
    # Calls go while their tenant is still over its share before each: two, not the third.
    assert q.displaceable("other", 1, 4, lambda rid: True) == [calls[2], calls[1]]
    assert q.displaceable("other", 1, 5, lambda rid: True) is None
    assert q.displaceable("flood", 1, 1, lambda rid: True) is None  # over its share: its own 429
    q.hold("other", 3)
    assert q.displaceable("other", 1, 1, lambda rid: True) is None  # "other" now at its share
    for call in calls:
        q.release(call)
        q.release(call)  # idempotent
    assert q.held == {"other": 3} and len(q.calls) == 1


def test_a_per_tenant_cap_holds_while_the_queue_has_room() -> None:
    q = TenantQueues(limit=100, per_tenant=2)
    q.hold("a", 2)
    assert q.over_cap("a", 1) and not q.over_cap("b", 2) and q.over_cap("b", 3)


async def _until(cond, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_a_flooding_tenant_cannot_keep_another_out_of_a_full_queue() -> None:
    r = await start_server(tiny_core(max_num_seqs=2), max_waiting_requests=4, http=True)
    long = build_request([1, 2, 3], max_new_tokens=2000, ignore_eos=True)
    flood = []
    try:
        for i in range(6):  # 2 seats and 4 places: the queue is full
            flood.append(r.stub.StreamGenerate(long, metadata=_as("flood")))
            await _until(lambda n=i + 1: r.core.scheduler.num_running + r.core.scheduler.num_waiting == n)
        with pytest.raises(grpc.aio.AioRpcError) as e:  # the flood's own next call: over its share
            await r.stub.Generate(long, metadata=_as("flood"))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Another tenant gets in (and a seat: the flood holds more than its share of those too).
        ok = await asyncio.wait_for(r.stub.Generate(build_request([4], max_new_tokens=2), metadata=_as("b")), 60)
        assert ok.usage.completion_tokens == 2
        # Its place came from the flood's youngest waiting call, refused as from a full queue.
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await flood[-1].read()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "share" in e.value.details()
        # Over HTTP the same: the flood's next call takes the free place; another tenant's takes it
        # from that one, whose client reads a 429 before any byte of an answer.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{r.server.http_port}", timeout=60) as http:
            body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 1000, "stream": True, "ignore_eos": True}
            flooding = asyncio.create_task(http.post("/v1/completions", json=body, headers=dict(_as("flood"))))
            await _until(lambda: len(r.server.frontend.queues.calls) == 4)
            ok = await asyncio.wait_for(r.stub.Generate(build_request([5], max_new_tokens=2), metadata=_as("c")), 60)
            assert ok.usage.completion_tokens == 2
            refused = await flooding
            assert refused.status_code == 429 and "share" in refused.json()["error"]["message"]
        assert r.core.scheduler.num_preemptions >= 1  # the flood's decodes gave a seat too
    finally:
        for call in flood:
            call.cancel()
        await r.channel.close()
        await r.server.shutdown()


async def test_the_per_tenant_cap_refuses_that_tenant_only() -> None:
    r = await start_server(tiny_core(max_num_seqs=1), max_waiting_requests=8, max_waiting_per_tenant=1)
    long = build_request([1, 2, 3], max_new_tokens=2000, ignore_eos=True)
    try:
        first = r.stub.StreamGenerate(long, metadata=_as("a"))
        await first.read()  # running: it holds no place
        second = r.stub.StreamGenerate(long, metadata=_as("a"))
        await _until(lambda: r.core.scheduler.num_waiting == 1)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await r.stub.Generate(long, metadata=_as("a"))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenant" in e.value.details()
        third = r.stub.StreamGenerate(long, metadata=_as("b"))
        await _until(lambda: r.core.scheduler.num_waiting == 2 or r.core.scheduler.num_running == 2)
        for call in (first, second, third):
            call.cancel()
    finally:
        await r.channel.close()
        await r.server.shutdown()
