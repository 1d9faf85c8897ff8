"""Shutdown (drain window, grace, final statuses), TLS and mTLS, reflection off."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchserve.async_engine import AsyncEngine
from batchserve.server.app import BatchServer, ServerConfig
from batchserve.server.client import build_request
from batchserve.v1 import generation_pb2 as pb
from batchserve.v1 import generation_pb2_grpc as pb_grpc
from tests.server.conftest import start_server, tiny_core


async def test_a_request_still_running_after_the_grace_period_ends_cancelled_with_a_final_message(monkeypatch):
    grace = 0.5
    running = await start_server(tiny_core(max_num_seqs=1), grace_seconds=grace)
    real = running.core.runner.launch

    def slow(out):  # 900 one-token steps of at least 5 ms: the stream outlasts the grace period
        time.sleep(0.005)
        return real(out)

    monkeypatch.setattr(running.core.runner, "launch", slow)
    req = build_request([1, 2, 3], max_new_tokens=900, ignore_eos=True, lookahead=False)
    long = running.stub.StreamGenerate(req)
    chunks = [await long.read()]
    waiting = running.stub.StreamGenerate(req)  # the only seat is taken: this one waits
    for _ in range(500):
        if running.core.scheduler.num_waiting == 1:
            break
        await asyncio.sleep(0.01)
    assert running.core.scheduler.num_waiting == 1
    started = time.monotonic()
    shutdown = asyncio.create_task(running.server.shutdown())
    while (chunk := await long.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    ended = time.monotonic() - started
    last = chunks[-1]
    # Not a cut connection: a last message that says CANCELLED, and an OK status.
    assert last.finish_reason == pb.FINISH_REASON_CANCELLED
    assert await long.code() == grpc.StatusCode.OK
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    streamed = sum(len(c.token_ids) for c in chunks)
    assert last.usage.completion_tokens == streamed and 0 < streamed < 900
    # Cancelled when the grace period ran out: never before it; the upper bound is loose (the
    # server polls every 50 ms, and a loaded machine delays the last step and the message).
    assert grace <= ended < grace + 1.5, ended
    # The waiting request is cancelled too, with a final message and no tokens.
    rest = [c async for c in waiting]
    assert [(c.finish_reason, c.usage.completion_tokens) for c in rest] == [(pb.FINISH_REASON_CANCELLED, 0)]
    assert await waiting.code() == grpc.StatusCode.OK
    # Every request is gone and every KV block is back in the pool, before the engine stops.
    load = running.server.engine.load()
    assert (load.num_running, load.num_waiting, load.num_free_kv_blocks) == (0, 0, load.num_kv_blocks)
    await asyncio.wait_for(shutdown, timeout=30)
    load = running.server.engine.load()
    assert (load.num_running, load.num_waiting, load.num_free_kv_blocks) == (0, 0, load.num_kv_blocks)
    await running.channel.close()


async def test_reflection_can_be_turned_off():
    running = await start_server(reflection=False)
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(running.channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
                pass
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await running.channel.close()
        await running.server.shutdown()


def _certificate(directory, name: str) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1 (it is also its own CA)."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}"),
            *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
async def test_tls_and_mutual_tls(tmp_path):
    cert, key = _certificate(tmp_path, "server")
    client_cert, client_key = _certificate(tmp_path, "client")
    root = open(cert, "rb").read()
    for mutual in (False, True):
        config = ServerConfig(
            port=0, http_port=0, tls_cert=cert, tls_key=key, tls_client_ca=client_cert if mutual else None
        )
        server = BatchServer(AsyncEngine(tiny_core()), config)
        port = await server.start()
        try:
            identity = {
                "private_key": open(client_key, "rb").read(),
                "certificate_chain": open(client_cert, "rb").read(),
            }
            good = grpc.ssl_channel_credentials(root, **(identity if mutual else {}))
            async with grpc.aio.secure_channel(f"localhost:{port}", good) as channel:
                reply = await pb_grpc.TextGenerationStub(channel).Generate(build_request([1, 2], max_new_tokens=3))
                assert reply.usage.completion_tokens == 3
            # Plaintext, or (mTLS) TLS without a client certificate, is refused.
            target = f"localhost:{port}"
            channel = (
                grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(root))
                if mutual
                else grpc.aio.insecure_channel(target)
            )
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    stub = pb_grpc.TextGenerationStub(channel)
                    await stub.Generate(build_request([1, 2], max_new_tokens=3), timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.shutdown()


def test_tls_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="both"):
        ServerConfig(tls_cert=str(tmp_path / "a.crt"))
    with pytest.raises(ValueError, match="no file"):
        ServerConfig(tls_cert=str(tmp_path / "a.crt"), tls_key=str(tmp_path / "a.key"))
