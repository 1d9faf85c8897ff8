"""No one without a key takes a replica down: connections per source and deadlines on the HTTP port
(`server.guard`), calls counted after the key (`openai.door`), /health ahead of everything, and on
the gRPC port health outside every limit, Watch streams capped per address, and calls without a
key refused before their message is read (`server.grpc.limits`)."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchserve.server.client import build_request
from batchserve.server.grpc.limits import CallGuard, peer_host
from batchserve.server.guard import ConnectionLimits, SourceCounts
from batchserve.server.openai.door import CallLimit
from tests.server.conftest import start_server, tiny_core
from tests.server.test_keys import ALICE, _key_file

FAST = {"request_head_seconds": 0.5, "request_body_seconds": 0.5}


async def _stop(r: Any) -> None:
    await r.channel.close()
    await r.server.shutdown()


def _get(port: int, path: str, key: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body


def _complete(port: int, key: str | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2})
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", "/v1/completions", body=body, headers=headers)
    status = conn.getresponse().status
    conn.close()
    return status


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> float:
    """How long until the server closed the connection (EOF or reset); fails after `seconds`."""
    t = time.monotonic()
    try:
        while await asyncio.wait_for(reader.read(1024), seconds):
            pass
    except ConnectionError:  # reset, or a broken pipe from our last write
        pass
    return time.monotonic() - t


async def test_idle_and_trickling_sockets_take_no_call_place_and_are_closed_at_their_deadlines():
    """200 sockets that send nothing (the call limit is 68): /health and a completion still answer
    at once; then every idle socket is closed at the head deadline, a trickled head too, and a
    body that stops coming at the body deadline."""
    r = await start_server(
        tiny_core(max_num_seqs=2), http=True, max_waiting_requests=2, max_connections_per_source=1000, **FAST
    )
    port = r.server.http_port
    try:
        assert r.server.max_calls < 200
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(200)]
        t = time.monotonic()
        assert await asyncio.to_thread(_get, port, "/health") == (200, b'{"status":"ok"}')
        assert await asyncio.to_thread(_complete, port) == 200
        assert time.monotonic() - t < 5
        waits = await asyncio.gather(*(_closed_within(reader, 5) for reader, _ in idle))
        assert max(waits) < 3  # 0.5 s deadline, generous for a loaded machine
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends: a byte at a time
        t = time.monotonic()
        for _ in range(4):
            await asyncio.sleep(0.2)
            try:
                writer.write(b"X")
            except ConnectionError:  # closed by the server already
                break
        assert await _closed_within(reader, 5) + (time.monotonic() - t) < 4
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"model"')
        assert await _closed_within(reader, 5) < 3
        assert r.server._http.connections.expired >= 202
        assert r.server._http.connections.open <= 1  # every one given back (this test's last may close now)
    finally:
        await _stop(r)


async def test_one_address_holds_at_most_its_share_and_health_reads_no_body():
    r = await start_server(http=True, max_connections_per_source=4)
    port = r.server.http_port
    try:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        reader, _ = await asyncio.open_connection("127.0.0.1", port)  # the fifth: closed unread
        assert await _closed_within(reader, 5) < 3
        assert r.server._http.connections.refused >= 1
        for _, writer in held:
            writer.close()
        await asyncio.sleep(0.2)
        # /health with a body announced and never sent: answered at once, the connection closed.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert await _closed_within(reader, 5) < 3
    finally:
        await _stop(r)


async def test_the_call_limit_counts_calls_and_gives_places_back():
    gate = asyncio.Event()
    entered = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal entered
        entered += 1
        await gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    refused: list[int] = []
    limit = CallLimit(app, 2, on_refuse=lambda: refused.append(1))
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": []}
    calls = [asyncio.create_task(limit(scope, receive, send)) for _ in range(2)]
    await asyncio.sleep(0.05)
    await limit(scope, receive, send)  # the third, at once
    assert sent[0]["status"] == 503 and refused == [1] and entered == 2
    gate.set()
    await asyncio.gather(*calls)
    assert limit.active == 0
    await limit(scope, receive, send)
    assert entered == 3


async def test_with_keys_the_schema_and_docs_need_the_key_and_health_does_not(tmp_path: Path):
    r = await start_server(http=True, api_key_file=str(_key_file(tmp_path)))
    port = r.server.http_port
    try:
        for path in ("/openapi.json", "/docs", "/v1/models"):
            assert (await asyncio.to_thread(_get, port, path))[0] == 401, path
            assert (await asyncio.to_thread(_get, port, path, ALICE))[0] == 200, path
        assert (await asyncio.to_thread(_get, port, "/health"))[0] == 200
    finally:
        await _stop(r)


async def test_health_watch_streams_are_capped_per_address_and_check_stays_free():
    """More Watch streams than the server has call places: an address holds its share, the rest
    are refused; Health.Check and Generate answer all along."""
    r = await start_server(tiny_core(max_num_seqs=2), max_waiting_requests=2, max_streams_per_source=4)
    health = health_pb2_grpc.HealthStub(r.channel)
    watches = []
    try:
        refused = 0
        for _ in range(r.server.max_calls + 10):
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                await watch.read()
                watches.append(watch)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "per address" in e.details()
                refused += 1
        assert len(watches) == 4 and refused == r.server.max_calls + 6
        reply = await asyncio.wait_for(health.Check(health_pb2.HealthCheckRequest(service="")), 1.0)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert (await r.stub.Generate(build_request([1, 2], max_new_tokens=2))).token_ids
        watches.pop().cancel()
        await asyncio.sleep(0.1)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        await watch.read()  # the place was given back
        watches.append(watch)
    finally:
        for watch in watches:
            watch.cancel()
        await _stop(r)


async def test_a_grpc_call_without_a_key_is_refused_before_its_message_is_read(tmp_path: Path):
    """A Generate that never sends its message: refused from its metadata at once (a handler that
    waited for the message would wait forever). With the key, the same call waits for it."""
    r = await start_server(api_key_file=str(_key_file(tmp_path)))
    method = "/batchserve.v1.TextGeneration/Generate"
    try:
        for _ in range(3):
            call = r.channel.stream_unary(method)(metadata=(("x-batchserve-tenant", "bob"),))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call, 5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        call = r.channel.stream_unary(method)(metadata=(("authorization", f"Bearer {ALICE}"),))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(call), 0.5)
        call.cancel()
    finally:
        await _stop(r)


async def test_keyed_calls_are_counted_against_the_call_limit():
    guard = CallGuard("batchserve.v1.TextGeneration", None, 1, SourceCounts(1, 1))
    gate = asyncio.Event()

    async def slow(request: Any, context: Any) -> str:
        await gate.wait()
        return "done"

    class Context:
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise RuntimeError(f"{code.name}: {details}")

        def peer(self) -> str:
            return "ipv4:10.0.0.1:5000"

    counted = guard._counted(slow)
    first = asyncio.create_task(counted(None, Context()))
    await asyncio.sleep(0.01)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED: server busy: 1 calls at once"):
        await counted(None, Context())
    gate.set()
    assert await first == "done" and guard.active == 0


def test_peer_addresses_lose_their_ports_and_limits_are_checked():
    assert peer_host("ipv4:10.0.0.1:5000") == "10.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "::1"
    assert peer_host("unix:/tmp/s") == "unix:/tmp/s"
    with pytest.raises(ValueError, match="per source"):
        ConnectionLimits(per_source=0)
    with pytest.raises(ValueError, match="deadlines"):
        ConnectionLimits(head_seconds=0)


async def test_a_grpc_request_that_never_arrives_ends_at_the_deadline_holding_no_place():
    """A Generate whose message never comes (or trickles in): DEADLINE_EXCEEDED after the body
    deadline, never a place of the call limit; a StreamGenerate the same; a real call still runs."""
    r = await start_server(request_body_seconds=0.5)
    try:
        for method in ("Generate", "StreamGenerate"):
            rpc = r.channel.stream_unary if method == "Generate" else r.channel.stream_stream
            call = rpc(f"/batchserve.v1.TextGeneration/{method}")()
            await asyncio.sleep(0.2)
            assert r.server.guard.active == 0  # waiting for its message: no place taken
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call if method == "Generate" else call.read(), 5)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "did not arrive" in e.value.details()
        assert (await r.stub.Generate(build_request([1, 2], max_new_tokens=2))).token_ids
        assert len([m async for m in r.stub.StreamGenerate(build_request([1, 2], max_new_tokens=3))]) >= 1
    finally:
        await _stop(r)


async def test_grpc_connections_are_capped_in_all_and_a_silent_one_is_closed_at_the_head_deadline():
    """grpc has no per-address cap (the front door has): a cap in all, and a connection that sends
    no HTTP/2 settings within the head deadline closed, so sockets that say nothing leave."""
    r = await start_server(max_connections=4, max_connections_per_source=4, request_head_seconds=1.0)
    health = health_pb2_grpc.HealthStub(r.channel)
    try:
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
        silent = [await asyncio.open_connection("127.0.0.1", r.server.port) for _ in range(3)]
        await asyncio.sleep(0.3)
        reader, _ = await asyncio.open_connection("127.0.0.1", r.server.port)  # the fifth: over the cap
        assert await _closed_within(reader, 5) < 1
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
        waits = await asyncio.gather(*(_closed_within(reader, 10) for reader, _ in silent))
        assert 0.5 < min(waits) and max(waits) < 6  # at the 1 s deadline, generous for a loaded machine
        async with grpc.aio.insecure_channel(f"127.0.0.1:{r.server.port}") as channel:  # room again
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert (await check).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await _stop(r)
