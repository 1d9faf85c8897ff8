"""The client's failover (`Client(failover=...)`) against two in-process replicas: a stream whose
replica dies mid-way is resumed on the other, the caller seeing the uninterrupted stream; a unary
call is sent again; refusals and deadlines are not retried. Its retries (issue 79): one budget of
attempts per call (gRPC's own retries off), jittered exponential pauses within the deadline, a
budget shared across calls, keepalive finding a replica gone silent, only grpc.RpcError out."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from batchserve.server import client as client_module
from batchserve.server.client import SERVICE, Client, ReplicaShutDown, RetryBudget
from batchserve.v1 import generation_pb2 as pb
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


# ---- the retry budget, backoff, keepalive and exceptions (issue 79, item 9) -------------------


class _Clock:
    """The client's `time`: its pauses recorded instead of slept."""

    monotonic = staticmethod(time.monotonic)

    def __init__(self) -> None:
        self.pauses: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)


@pytest.fixture
def no_pause(monkeypatch):
    """The pauses between attempts, recorded instead of slept (the client's alone)."""
    clock = _Clock()
    monkeypatch.setattr(client_module, "time", clock)
    return clock.pauses


def _refusing_server(code: grpc.StatusCode) -> tuple[grpc.Server, int, list[str]]:
    """A plain gRPC server whose Generate and StreamGenerate answer `code` at once, counting calls."""
    calls: list[str] = []

    def unary(request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        calls.append("Generate")
        context.abort(code, "refused")

    def stream(request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateStreamResponse]:
        calls.append("StreamGenerate")
        context.abort(code, "refused")
        yield pb.GenerateStreamResponse()  # pragma: no cover - abort raises

    wire = {"request_deserializer": pb.GenerateRequest.FromString}
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            unary, response_serializer=pb.GenerateResponse.SerializeToString, **wire
        ),
        "StreamGenerate": grpc.unary_stream_rpc_method_handler(
            stream, response_serializer=pb.GenerateStreamResponse.SerializeToString, **wire
        ),
    }
    server = grpc.server(ThreadPoolExecutor(4), handlers=[grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, calls


@pytest.mark.parametrize("load_balancing", ["round_robin", "pick_first", None])
def test_a_failing_call_makes_failover_plus_one_attempts_in_all(no_pause, load_balancing):
    # gRPC's own retry policy (3 attempts) under the client's failover (4) made 12 before.
    server, port, calls = _refusing_server(grpc.StatusCode.UNAVAILABLE)
    try:
        with Client(f"127.0.0.1:{port}", load_balancing=load_balancing, failover=3) as client:
            with pytest.raises(grpc.RpcError) as e:
                client.generate(PROMPT, max_new_tokens=4)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE and calls == ["Generate"] * 4
            del calls[:]
            with pytest.raises(grpc.RpcError):
                list(client.stream(PROMPT, max_new_tokens=4))
            assert calls == ["StreamGenerate"] * 4 and client.failovers == 6 and len(no_pause) == 6
    finally:
        server.stop(None)


def test_refusals_are_sent_once():
    server, port, calls = _refusing_server(grpc.StatusCode.RESOURCE_EXHAUSTED)
    try:
        with Client(f"127.0.0.1:{port}") as client, pytest.raises(grpc.RpcError) as e:
            client.generate(PROMPT, max_new_tokens=4)
        assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and calls == ["Generate"]
    finally:
        server.stop(None)


class _DownStub:
    """Every replica gone: each call fails UNAVAILABLE at once."""

    def __init__(self) -> None:
        self.calls = 0

    def Generate(self, req: Any, **kwargs: Any) -> Any:  # grpc's method name
        self.calls += 1
        raise _Cut()


def test_pauses_are_jittered_exponential_and_end_within_the_deadline(no_pause):
    client = Client("127.0.0.1:1", failover=5, retry_budget=RetryBudget(reserve=1000))
    client.stub = _DownStub()
    for _ in range(20):
        with pytest.raises(grpc.RpcError):
            client.generate(PROMPT, max_new_tokens=4)
    firsts, lasts = no_pause[0::5], no_pause[4::5]  # each call's first and last pause
    low, high = client_module.BACKOFF_S
    assert all(0 <= p <= low for p in firsts) and all(0 <= p <= min(high, low * 16) for p in lasts)
    assert len(set(firsts)) == 20 and max(lasts) > low  # jittered, and growing
    del no_pause[:]
    client.timeout = 0.01
    with pytest.raises(grpc.RpcError):
        client.generate(PROMPT, max_new_tokens=4)
    assert all(p <= 0.01 for p in no_pause)  # never past the call's deadline
    client.close()


def test_one_retry_budget_bounds_failovers_across_calls_and_clients(no_pause):
    budget = RetryBudget(ratio=0.5, reserve=2)
    clients = [Client("127.0.0.1:1", failover=3, retry_budget=budget) for _ in range(2)]
    attempts = []
    for client in (*clients, *clients):
        client.stub = _DownStub()
        with pytest.raises(grpc.RpcError) as e:
            client.generate(PROMPT, max_new_tokens=4)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        attempts.append(client.stub.calls)
    # 2 in reserve, then half a failover per call: 3, 1, 2, 1 attempts instead of 4 each.
    assert attempts == [3, 1, 2, 1] and sum(c.refused for c in clients) == 4
    with pytest.raises(ValueError):
        RetryBudget(ratio=-1)
    for client in clients:
        client.close()


class _ShuttingDownStub:
    """Every replica shuts down under each call: Generate replies CANCELLED, a stream ends so."""

    def __init__(self) -> None:
        self.calls = 0

    def Generate(self, req: Any, **kwargs: Any) -> pb.GenerateResponse:  # grpc's method name
        self.calls += 1
        return pb.GenerateResponse(finish_reason=pb.FINISH_REASON_CANCELLED)

    def StreamGenerate(self, req: Any, **kwargs: Any) -> Iterator[pb.GenerateStreamResponse]:
        self.calls += 1
        yield pb.GenerateStreamResponse(token_ids=[7], text="a")
        yield pb.GenerateStreamResponse(finish_reason=pb.FINISH_REASON_CANCELLED)


def test_a_call_no_replica_could_finish_raises_a_grpc_error(no_pause):
    client = Client("127.0.0.1:1", failover=2)
    client.stub = _ShuttingDownStub()
    with pytest.raises(grpc.RpcError) as e:  # a private exception escaped before
        client.generate(PROMPT, max_new_tokens=4)
    assert isinstance(e.value, ReplicaShutDown) and e.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "shut down" in e.value.details() and client.stub.calls == 3
    got = []
    with pytest.raises(grpc.RpcError) as e:
        got.extend(client.stream(PROMPT, max_new_tokens=8))
    assert isinstance(e.value, ReplicaShutDown) and [list(m.token_ids) for m in got] == [[7]] * 3
    client.close()


class _SilentProxy:
    """A TCP relay to a replica that can go silent: it stops relaying both ways and takes no new
    connection, leaving the open ones open (a replica whose host vanished: no FIN, no RST)."""

    def __init__(self, upstream: int) -> None:
        self.upstream, self.silent, self.writers = upstream, False, []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def go_silent(self) -> None:
        self.silent = True
        self.server.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        self.writers += [writer, up_writer]
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not self.silent and (data := await reader.read(65536)):
            if not self.silent:
                writer.write(data)
                await writer.drain()
        if not self.silent:
            writer.close()

    def close(self) -> None:
        for w in self.writers:
            w.close()


async def test_a_replica_gone_silent_is_found_by_keepalive_and_the_call_finishes_elsewhere():
    b = await start_server()
    proxy = _SilentProxy(b.server.port)
    try:
        port = await proxy.start()
        reference = Client(f"127.0.0.1:{b.server.port}")
        whole = await asyncio.to_thread(lambda: list(reference.stream(PROMPT, **ARGS)))
        reference.close()
        # The proxy first; a deadline far beyond what keepalive (1 s + 1 s) needs to find it dead.
        target = f"ipv4:127.0.0.1:{port},127.0.0.1:{b.server.port}"
        client = Client(target, timeout=60, load_balancing="pick_first", keepalive=(1.0, 1.0))
        await asyncio.to_thread(client.generate, PROMPT, max_new_tokens=2)  # connected through the proxy
        proxy.go_silent()
        started = time.monotonic()
        got = await asyncio.to_thread(lambda: list(client.stream(PROMPT, **ARGS)))
        assert time.monotonic() - started < 15  # without keepalive: the whole deadline, then DEADLINE_EXCEEDED
        assert [t for m in got for t in m.token_ids] == [t for m in whole for t in m.token_ids]
        client.close()
    finally:
        proxy.close()
        await _close(b)
