"""Preparation (tokenizing, grammar compiling) one job at a time, taken from the tenants in turn: a
tenant's wait is at most one job of each other tenant, a caller that leaves takes its job out of the
queue, a call in preparation gives its places to a tenant within its share, and while others have
calls a tenant's time on the threads is paced."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from batchserve.server.client import build_request
from batchserve.server.fair_work import FairWork, Pacing, preparation_share
from tests.server.conftest import start_server, tiny_core
from tests.server.test_queue_shares import _as, _until


def _gated() -> tuple[FairWork, threading.Event, list[str], Any]:
    """A FairWork on one thread, and a job that waits for the gate, then logs and returns its name."""
    gate, ran = threading.Event(), []

    def job(name: str) -> str:
        gate.wait(10)
        ran.append(name)
        return name

    return FairWork(ThreadPoolExecutor(max_workers=1)), gate, ran, job


async def test_a_tenant_waits_for_one_job_of_each_other_tenant_not_for_their_queues():
    work, gate, order, job = _gated()
    flood = [asyncio.ensure_future(work.run("flood", object(), 1, job, f"f{i}")) for i in range(5)]
    await asyncio.sleep(0.05)  # f0 is running: the rest queue behind it
    other = asyncio.ensure_future(work.run("other", object(), 1, job, "o"))
    await asyncio.sleep(0.05)
    assert work.preparing == 6
    gate.set()
    assert await other == "o" and await asyncio.gather(*flood) == [f"f{i}" for i in range(5)]
    assert order[:2] == ["f0", "o"]  # the other tenant's one job right after the running one
    assert work.preparing == 0


async def test_a_job_whose_caller_left_or_whose_call_was_dropped_never_starts():
    work, gate, ran, job = _gated()
    owner = object()
    first = asyncio.ensure_future(work.run("a", object(), 1, job, "first"))
    left = asyncio.ensure_future(work.run("a", object(), 2, job, "left"))
    dropped = asyncio.ensure_future(work.run("b", owner, 3, job, "dropped"))
    await asyncio.sleep(0.05)
    assert work.preparing == 6
    left.cancel()
    await asyncio.sleep(0)
    work.drop(owner, RuntimeError("its places went to another call"))
    assert work.preparing == 1  # the running job alone
    with pytest.raises(RuntimeError, match="another call"):
        await dropped
    gate.set()
    await first
    assert ran == ["first"] and work.preparing == 0


async def test_a_call_in_preparation_gives_its_places_to_a_tenant_within_its_share(monkeypatch):
    """A flood holding the whole queue with calls stuck in tokenizing: another tenant still gets in,
    on the places of the flood's youngest call in preparation, which is refused as from a full queue
    without ever being tokenized."""
    r = await start_server(tiny_core(max_num_seqs=1), max_waiting_requests=3)
    gate, seen = threading.Event(), []
    from batchserve.server.grpc import convert

    prompt_of = convert.prompt_of

    def slow(request, text):
        ids = prompt_of(request, text)
        seen.append(ids)
        if ids[0] == 1:
            gate.wait(30)
        return ids

    monkeypatch.setattr(convert, "prompt_of", slow)
    calls = []
    try:
        running = r.stub.StreamGenerate(build_request([9], max_new_tokens=2000, ignore_eos=True), metadata=_as("x"))
        await running.read()  # the one seat is taken: every new call waits
        for i in range(3):  # the queue's 3 places: the first is tokenized (stuck), the rest wait their turn
            calls.append(r.stub.Generate(build_request([1, i], max_new_tokens=2), metadata=_as("flood")))
            await asyncio.sleep(0.05)
        await _until(lambda: len(r.server.frontend.queues.calls) == 3)
        ok = asyncio.ensure_future(r.stub.Generate(build_request([5], max_new_tokens=2), metadata=_as("b")))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(calls[-1], 10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "share" in e.value.details()
        assert [1, 2] not in seen  # displaced before its turn came: never tokenized
        gate.set()
        running.cancel()
        assert (await asyncio.wait_for(ok, 60)).usage.completion_tokens == 2
    finally:
        gate.set()
        for call in calls:
            call.cancel()
        await r.channel.close()
        await r.server.shutdown()


def test_pacing_owes_time_only_beside_others_and_at_most_one_burst():
    others = {"on": True}
    pacing = Pacing(share=0.5, burst=1.0, contended=lambda tenant: others["on"])
    assert pacing.wait("a", 0.0) == 0
    pacing.charge("a", 3.0, 0.0)  # 3 s beside others: owes them, down to one burst's worth
    assert pacing.balance("a", 0.0) == -1.0 and pacing.wait("a", 0.0) == 2.0
    assert pacing.wait("a", 1.0) == 1.0 and pacing.wait("a", 2.0) == 0
    assert pacing.wait("b", 1.0) == 0  # another tenant owes nothing
    others["on"] = False
    assert pacing.wait("a", 1.0) == 0  # alone: never paced
    pacing.charge("c", 5.0, 1.0)  # and nothing charged
    assert "c" not in pacing._owed
    assert pacing.wait("a", 10.0) == 0 and "a" not in pacing._owed  # refilled: forgotten
    assert preparation_share(None, "cpu") > 0 and preparation_share(None, "cuda") == 0
    assert preparation_share(0.5, "cuda") == 0.5


async def _flood_seconds(work: FairWork, jobs: int) -> float:
    t = time.monotonic()
    await asyncio.gather(*(work.run("flood", object(), 1, time.sleep, 0.02) for _ in range(jobs)))
    return time.monotonic() - t


async def test_a_paced_tenant_waits_for_its_time_and_another_tenant_goes_first():
    """Ten jobs of 20 ms: at once while the tenant is alone; beside another tenant's calls at
    0.1 s a second after a 20 ms burst (so 1.8 s at least), with the other tenant's job run
    at once meanwhile."""
    others = {"on": False}
    pacing = Pacing(share=0.1, burst=0.02, contended=lambda tenant: others["on"] and tenant == "flood")
    work = FairWork(ThreadPoolExecutor(max_workers=1), pacing)
    assert await _flood_seconds(work, 10) < 1.0  # alone: back to back
    others["on"] = True
    flood = asyncio.ensure_future(_flood_seconds(work, 10))
    await asyncio.sleep(0.3)  # the flood has spent its burst and waits for its time
    t = time.monotonic()
    assert await work.run("other", object(), 1, lambda: "o") == "o"
    assert time.monotonic() - t < 0.25
    assert await flood >= 1.8 - 0.3
    assert work.preparing == 0


async def test_the_frontend_counts_each_tenants_calls_until_they_end():
    r = await start_server(tiny_core(max_num_seqs=2))
    try:
        stream = r.stub.StreamGenerate(build_request([9], max_new_tokens=2000, ignore_eos=True), metadata=_as("x"))
        await stream.read()
        frontend = r.server.frontend
        assert dict(frontend.active) == {"x": 1} and not frontend._others_active("x") and frontend._others_active("y")
        assert (await r.stub.Generate(build_request([5], max_new_tokens=2), metadata=_as("y"))).token_ids
        stream.cancel()
        await _until(lambda: not frontend.active)
    finally:
        await r.channel.close()
        await r.server.shutdown()


def test_tenants_that_never_come_back_leave_the_pacing_table_once_repaid():
    """Without keys a client may send a fresh tenant string a call: the table of what tenants owe
    is swept as it grows, keeping only those still owing."""
    pacing = Pacing(share=0.5, burst=1.0, contended=lambda tenant: True)
    for i in range(1000):
        pacing.charge(f"rotated-{i}", 2.0, now=i * 0.001)  # each owes a burst, repaid 4 s later
    assert len(pacing._owed) <= 1000
    for i in range(200):
        pacing.charge(f"later-{i}", 2.0, now=100.0 + i * 0.001)
    assert len(pacing._owed) <= 400 and all(not t.startswith("rotated") for t in pacing._owed)
