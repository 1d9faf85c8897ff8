"""The client's failover (`Client(failover=...)`) against two in-process replicas: a stream whose
replica dies mid-way is resumed on the other, the caller seeing the uninterrupted stream; a unary
call is sent again; refusals and deadlines are not retried."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
import pytest

from batchserve.server.client import Client
from tests.server.conftest import start_server

PROMPT = [72, 101, 108, 108, 111]
ARGS: dict[str, Any] = {"max_new_tokens": 40, "ignore_eos": True}


async def _replicas() -> tuple[Any, Any]:
    return await start_server(), await start_server()


async def _kill(r: Any) -> None:
    """The replica's gRPC listener gone at once (in-flight calls cut), then its engine stopped."""
    await r.server._server.stop(0)
    await r.channel.close()
    await r.server.engine.stop()


async def _close(r: Any) -> None:
    await r.channel.close()
    await r.server.shutdown()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 4}])
async def test_a_stream_whose_replica_dies_is_resumed_on_the_other_unchanged(sampling):
    a, b = await _replicas()
    try:
        reference = Client(f"127.0.0.1:{b.server.port}")
        whole = await asyncio.to_thread(lambda: list(reference.stream(PROMPT, **ARGS, **sampling)))
        reference.close()
        target = f"ipv4:127.0.0.1:{a.server.port},127.0.0.1:{b.server.port}"
        client = Client(target, timeout=60, load_balancing="pick_first")  # a first, while it lives
        loop = asyncio.get_running_loop()
        got: list[Any] = []
        killed = threading.Event()

        def consume() -> None:
            for msg in client.stream(PROMPT, **ARGS, **sampling):
                got.append(msg)
                if len(got) == 2 and not killed.is_set():
                    asyncio.run_coroutine_threadsafe(_kill(a), loop).result(timeout=30)
                    killed.set()

        await asyncio.to_thread(consume)
        assert killed.is_set() and client.failovers >= 1
        assert [t for m in got for t in m.token_ids] == [t for m in whole for t in m.token_ids]
        assert "".join(m.text for m in got) == "".join(m.text for m in whole)
        assert got[-1].finish_reason == whole[-1].finish_reason and got[-1].usage.completion_tokens == 40
        client.close()
    finally:
        await _close(b)
        if not a.server._stopped.is_set():
            await _close(a)


async def test_unary_calls_go_to_the_live_replica_and_refusals_are_not_retried():
    a, b = await _replicas()
    try:
        await _kill(a)
        client = Client(f"ipv4:127.0.0.1:{a.server.port},127.0.0.1:{b.server.port}", timeout=30)
        reply = await asyncio.to_thread(client.generate, PROMPT, **ARGS)
        assert len(reply.token_ids) == 40
        before = client.failovers
        with pytest.raises(grpc.RpcError) as e:
            await asyncio.to_thread(client.generate, PROMPT, max_new_tokens=4, stop_token_ids=[1 << 40])
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and client.failovers == before
        client.close()
    finally:
        await _close(b)


class _Cut(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class _FlakyStub:
    """A stub whose first stream breaks after `messages`; the next ones see what they were asked."""

    def __init__(self, messages: list[Any]) -> None:
        self.messages, self.asked = messages, []

    def StreamGenerate(self, req: Any, **kwargs: Any) -> Any:  # grpc's method name
        from batchserve.v1 import generation_pb2 as pb

        self.asked.append(list(req.resume_token_ids))
        if len(self.asked) == 1:
            yield from self.messages
            raise _Cut()
        yield pb.GenerateStreamResponse(token_ids=[9], finish_reason=pb.FINISH_REASON_LENGTH)


def test_a_replica_that_dies_after_the_last_message_costs_nothing_and_one_before_it_is_resumed():
    from batchserve.v1 import generation_pb2 as pb

    client = Client("127.0.0.1:1", failover=2)
    done = [pb.GenerateStreamResponse(token_ids=[1, 2]), pb.GenerateStreamResponse(token_ids=[3], finish_reason=1)]
    client.stub = _FlakyStub(done)
    assert [list(m.token_ids) for m in client.stream(PROMPT, max_new_tokens=3)] == [[1, 2], [3]]
    assert client.stub.asked == [[]] and client.failovers == 0  # complete: no resume of a finished stream
    client.stub = _FlakyStub(done[:1])
    assert [list(m.token_ids) for m in client.stream(PROMPT, max_new_tokens=3)] == [[1, 2], [9]]
    assert client.stub.asked == [[], [1, 2]] and client.failovers == 1
    client.close()
