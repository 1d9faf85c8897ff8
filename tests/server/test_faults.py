"""A server whose engine stops for good reports NOT_SERVING, refuses calls and exits 1."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchserve.server.app import serve_forever
from batchserve.server.client import build_request
from tests.server.conftest import Running, start_server


async def test_a_dead_engine_ends_streams_goes_not_serving_and_exits_nonzero(monkeypatch):
    running: Running = await start_server(drain_seconds=2.0)
    server = running.server
    server.engine.max_failed_steps = 2

    def device_lost(out):
        raise RuntimeError("device lost")

    monkeypatch.setattr(server.engine.core.runner, "launch", device_lost)
    # serve_forever drives the server from here on (it was started above; start() again is a no-op
    # for the engine, and the health and listener are already up).
    monkeypatch.setattr(server, "start", _already_started(server))
    exit_code = asyncio.create_task(serve_forever(server))
    for _ in range(2):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(running.stub.Generate(build_request([1, 2, 3], max_new_tokens=5)), timeout=10)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "device lost" in e.value.details()
    health = health_pb2_grpc.HealthStub(running.channel)
    status = None
    for _ in range(100):  # within the drain window, before the listener closes
        status = (await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)).status
        if status == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
        await asyncio.sleep(0.01)
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await asyncio.wait_for(exit_code, timeout=30) == 1
    assert server.engine.dead is not None
    with pytest.raises(grpc.aio.AioRpcError):  # the listener is closed after the shutdown
        await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    await running.channel.close()


def _already_started(server):
    async def start() -> int:
        assert server.port is not None
        return server.port

    return start
