"""What no client may do to the server or to another tenant: stop it, make it do unbounded work
before admission, or pick another tenant's scope. Real servers on loopback, real clients."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchserve.request import FinishReason
from batchserve.server.app import PortInUse, ServerConfig
from batchserve.server.client import build_request
from batchserve.server.openai.auth import user_tenant
from batchserve.v1 import generation_pb2 as pb
from tests.server.conftest import start_server, tiny_core
from tests.server.test_openai_api import _post_and_keep_open, _raw


async def _stop(r) -> None:
    await r.channel.close()
    await r.server.shutdown()


# ---- 1, 2: numbers are range-checked where they enter; failures pinned to a request ---------


@pytest.mark.parametrize(
    ("field", "value"), [("seed", 2**64), ("seed", -(2**63) - 1), ("top_k", 2**63), ("temperature", 1e9)]
)
async def test_http_numbers_out_of_range_are_400_naming_the_field_and_the_server_goes_on(field, value):
    r = await start_server(http=True)
    try:
        for _ in range(4):  # more than max_failed_steps: none of them reaches the runner
            code, reply = await _raw(r, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", field: value})
            assert code == 400 and reply["error"]["param"] == field, reply
        code, _ = await _raw(r, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert code == 200 and r.server.engine.dead is None
    finally:
        await _stop(r)


def _sampling(**fields):
    def set_fields(req: pb.GenerateRequest) -> None:
        for name, value in fields.items():
            setattr(req.sampling, name, value)

    return set_fields


def _lookahead(**fields):
    def set_fields(req: pb.GenerateRequest) -> None:
        for name, value in fields.items():
            setattr(req.lookahead, name, value)

    return set_fields


async def test_grpc_numbers_out_of_range_are_invalid_argument_naming_the_field_and_nothing_is_queued(monkeypatch):
    r = await start_server()
    seen = await _tenants(r, monkeypatch)  # every request that reaches the engine
    cases = [
        (_sampling(temperature=float("inf")), "temperature"),
        (_sampling(temperature=float("nan")), "temperature"),
        (_sampling(temperature=1e9), "temperature"),
        (_sampling(temperature=-1.0), "temperature"),
        (_sampling(top_p=1.5), "top_p"),
        (_sampling(top_p=0.0), "top_p"),
        (_sampling(top_p=float("nan")), "top_p"),
        (_sampling(top_k=-1), "top_k"),
        (_sampling(max_new_tokens=0), "max_new_tokens"),
        (_sampling(max_new_tokens=-5), "max_new_tokens"),
        (lambda req: req.sampling.stop_token_ids.append(2**40), "stop_token_ids"),
        (lambda req: req.sampling.stop_token_ids.append(-1), "stop_token_ids"),
        (_lookahead(decoding_length=-1), "decoding_length"),
        (_lookahead(jacobi_window=0), "jacobi"),
        (_lookahead(jacobi_ngram=1), "jacobi"),
    ]
    try:
        for set_fields, field in cases:
            req = build_request([1, 2, 3], max_new_tokens=2)
            set_fields(req)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await r.stub.Generate(req)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.value.details())
            assert field in e.value.details(), (field, e.value.details())
        assert seen == [] and r.core.scheduler.num_waiting == 0 and r.server.frontend._preparing == 0
        # top_k's wire type is int32, so its largest value is in range: it means "no cut" and runs.
        with pytest.raises(ValueError):
            pb.SamplingOptions(top_k=2**31)
        reply = await r.stub.Generate(
            build_request([1, 2, 3], max_new_tokens=4, temperature=100.0, top_k=2**31 - 1, top_p=1.0, seed=2**64 - 1)
        )
        assert reply.usage.completion_tokens == 4 and len(seen) == 1 and r.server.engine.dead is None
    finally:
        await _stop(r)


async def test_requests_built_to_fail_in_the_runner_never_stop_the_server(monkeypatch):
    r = await start_server(http=True)
    core = r.core
    real = core.runner.launch

    def poisoned(out):  # a request whose forward always fails, whatever else shares the step
        if any(x.token_ids[:1] == (99,) for x in out.requests if x.num_computed_tokens == 0):
            raise RuntimeError("poisoned")
        return real(out)

    monkeypatch.setattr(core.runner, "launch", poisoned)
    try:
        for _ in range(5):  # alone, one after another
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await r.stub.Generate(build_request([99, 1, 2], max_new_tokens=4))
            assert e.value.code() == grpc.StatusCode.INTERNAL
        calls = [r.stub.Generate(build_request([99 if i % 2 else 1 + i, 2, 3], max_new_tokens=6)) for i in range(10)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        good = [x for i, x in enumerate(results) if i % 2 == 0]
        assert all(isinstance(x, pb.GenerateResponse) and x.usage.completion_tokens == 6 for x in good)
        health = health_pb2_grpc.HealthStub(r.channel)
        status = (await health.Check(health_pb2.HealthCheckRequest(service=""))).status
        assert status == health_pb2.HealthCheckResponse.SERVING and r.server.engine.dead is None
        assert (await _raw(r, "GET", "/health"))[0] == 200
    finally:
        await _stop(r)


# ---- 4: tenancy a gateway can enforce --------------------------------------------------------


async def _tenants(r, monkeypatch) -> list[str]:
    seen: list[str] = []
    real = r.core.add_request

    def spy(sub):
        seen.append(sub.tenant)
        return real(sub)

    monkeypatch.setattr(r.core, "add_request", spy)
    return seen


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("header", ["", "gw", "", "gw", "gw"]),  # the default: only what a gateway sets
        ("request", ["body", "body", user_tenant("alice@example.com"), user_tenant("alice@example.com"), ""]),
        ("both", ["body", "gw", user_tenant("alice@example.com"), "gw", "gw"]),
    ],
)
async def test_the_tenant_key_comes_from_where_the_server_says(monkeypatch, source, expected):
    r = await start_server(http=True, tenant_source=source)
    seen = await _tenants(r, monkeypatch)
    gw = (("x-batchserve-tenant", "gw"),)
    try:
        await r.stub.Generate(build_request([1, 2], max_new_tokens=2, tenant="body"))
        await r.stub.Generate(build_request([1, 2], max_new_tokens=2, tenant="body"), metadata=gw)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "alice@example.com"}  # any string works
        assert (await _raw(r, "POST", "/v1/completions", body))[0] == 200
        assert (await _raw(r, "POST", "/v1/completions", body, headers={"x-batchserve-tenant": "gw"}))[0] == 200
        await r.stub.Generate(build_request([1, 2], max_new_tokens=2), metadata=gw)
        assert seen == expected
    finally:
        await _stop(r)


def test_a_hashed_user_is_a_valid_key_that_shows_nothing_of_the_user():
    key = user_tenant("alice@example.com")
    assert key is not None and "alice" not in key and len(key) == 34 and key == user_tenant("alice@example.com")
    assert user_tenant("") is None and user_tenant(None) is None


# ---- 6, 7: bounded lists; admission covers the work before the engine ------------------------


async def test_lists_are_counted_before_their_items_are_checked():
    r = await start_server(http=True)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await r.stub.Generate(build_request([1, 2], max_new_tokens=2, stop_token_ids=list(range(10_000))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids: 10000 ids" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await r.stub.Generate(build_request([{"role": "user", "content": ""}] * 2000, max_new_tokens=2))
        assert "2000 messages, at most 1024" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:  # ids out of the vocabulary, and too many of them
            await r.stub.Generate(build_request([10**9] * 5000, max_new_tokens=2))
        assert "5000 tokens" in e.value.details()
        code, reply = await _raw(
            r, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "stop_token_ids": list(range(65))}
        )
        assert code == 400 and "65 ids, at most 64" in reply["error"]["message"]
    finally:
        await _stop(r)


async def test_requests_being_prepared_hold_places_in_the_queue(monkeypatch):
    # 1 seat, a queue of 2: while 3 requests sit in a slow tokenizer, a 4th is refused at once,
    # and so is Tokenize, which is the same work.
    r = await start_server(tiny_core(max_num_seqs=1), http=True, max_waiting_requests=2)
    gate = threading.Event()
    text = r.core.text
    real = text.tokenize

    def slow(prompt, *field):
        gate.wait(10)
        return real(prompt, *field)

    monkeypatch.setattr(text, "tokenize", slow)
    try:
        held = [asyncio.ensure_future(r.stub.Generate(build_request("abc", max_new_tokens=2))) for _ in range(3)]
        while r.server.frontend._preparing < 3:
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await r.stub.Generate(build_request("abc", max_new_tokens=2))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await r.stub.Tokenize(pb.TokenizeRequest(text="abc"))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        code, _ = await _raw(r, "POST", "/v1/completions", {"model": "tiny", "prompt": "x"})
        assert code == 429
        gate.set()
        assert all(x.usage.completion_tokens == 2 for x in await asyncio.gather(*held))
        assert r.server.frontend._preparing == 0
    finally:
        gate.set()
        await _stop(r)


async def test_a_caller_that_leaves_keeps_its_place_until_its_tokenizing_ends(monkeypatch):
    r = await start_server(tiny_core(max_num_seqs=1), max_waiting_requests=1)
    gate = threading.Event()
    real = r.core.text.tokenize
    monkeypatch.setattr(r.core.text, "tokenize", lambda prompt, *field: (gate.wait(10), real(prompt, *field))[1])
    try:
        call = r.stub.Generate(build_request("abc", max_new_tokens=2))
        task = asyncio.ensure_future(call)
        while r.server.frontend._preparing < 1:
            await asyncio.sleep(0.01)
        call.cancel()  # the client left, its tokenizing still runs: the place stays taken
        await asyncio.sleep(0.1)
        assert r.server.frontend._preparing == 1
        gate.set()
        for _ in range(100):
            if r.server.frontend._preparing == 0:
                break
            await asyncio.sleep(0.02)
        assert r.server.frontend._preparing == 0
        with pytest.raises((asyncio.CancelledError, grpc.aio.AioRpcError)):
            await task
    finally:
        gate.set()
        await _stop(r)


# ---- 8: leaving clients ---------------------------------------------------------------------


async def test_an_http_client_that_leaves_while_queued_frees_its_place_at_once():
    r = await start_server(tiny_core(max_num_seqs=1), http=True)
    core = r.core
    try:
        running = asyncio.ensure_future(r.stub.Generate(build_request([1, 2, 3], max_new_tokens=300, ignore_eos=True)))
        while not core.scheduler.num_running:
            await asyncio.sleep(0.01)
        body = json.dumps({"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 50}).encode()
        _, writer = await _post_and_keep_open(r, body)
        while not core.scheduler.num_waiting:
            await asyncio.sleep(0.01)
        queued = core.scheduler.waiting[0]
        writer.close()
        for _ in range(200):
            if not core.scheduler.num_waiting:
                break
            await asyncio.sleep(0.01)
        assert not core.scheduler.num_waiting and queued.finish_reason is FinishReason.CANCELLED
        assert not running.done()  # gone while the seat was still taken by the first request
        await running
    finally:
        await _stop(r)


async def test_an_http_client_that_leaves_during_its_prefill_frees_seat_and_kv_within_a_step(monkeypatch):
    r = await start_server(tiny_core(max_num_seqs=1, max_num_batched_tokens=16), http=True)
    core = r.core
    real = core.runner.launch
    steps = {"n": 0}

    def slow(out):  # a long prefill: each prompt chunk takes a while
        steps["n"] += 1
        threading.Event().wait(0.2)
        return real(out)

    monkeypatch.setattr(core.runner, "launch", slow)
    try:
        for stream in (False, True):
            prompt = list(range(1, 200))  # 13 chunks of 16 tokens: no output before ~2.6 s
            body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 5, "stream": stream}).encode()
            _, writer = await _post_and_keep_open(r, body)
            while not core.scheduler.num_running:
                await asyncio.sleep(0.01)
            req = core.scheduler.running[0]
            await asyncio.sleep(0.3)
            assert not req.output_token_ids and req.num_computed_tokens < len(prompt)
            writer.close()
            at_close = steps["n"]
            while core.scheduler.has_work():
                await asyncio.sleep(0.01)
            assert req.finish_reason is FinishReason.CANCELLED and not req.output_token_ids
            assert steps["n"] - at_close <= 2  # the step in flight, at most one more
            assert core.scheduler.allocator.num_free_blocks == core.scheduler.allocator.num_blocks
    finally:
        await _stop(r)


# ---- 9: the loop and shutdown ---------------------------------------------------------------


async def test_a_request_prepared_while_shutdown_began_is_unavailable_not_cancelled(monkeypatch):
    r = await start_server()
    gate = threading.Event()
    real = r.core.text.tokenize
    monkeypatch.setattr(r.core.text, "tokenize", lambda prompt, *field: (gate.wait(10), real(prompt, *field))[1])
    try:
        task = asyncio.ensure_future(r.stub.Generate(build_request("abc", max_new_tokens=2)))
        while r.server.frontend._preparing < 1:
            await asyncio.sleep(0.01)
        r.server.frontend.draining = True
        gate.set()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await task
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # clients retry this one elsewhere
    finally:
        gate.set()
        await _stop(r)


async def test_http_health_is_503_from_the_moment_grpc_health_is_not_serving():
    r = await start_server(http=True, drain_seconds=1.0)
    health = health_pb2_grpc.HealthStub(r.channel)
    stopping = asyncio.ensure_future(r.server.shutdown())
    try:
        while (await health.Check(health_pb2.HealthCheckRequest(service=""))).status == 1:  # SERVING
            await asyncio.sleep(0.01)
        assert not r.server.frontend.draining  # still in the drain window, still taking calls
        assert (await _raw(r, "GET", "/health"))[0] == 503
    finally:
        await stopping
        await r.channel.close()


def admin_token_file(tmp_path: Path, token: str) -> str:
    path = tmp_path / "admin-token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


def test_an_empty_weak_or_missing_admin_token_file_is_refused_at_start(tmp_path):
    for token, why in [("", "one line"), ("short", "too easy"), ("a" * 40, "too easy"), ("x" * 30 + "\ny", "one line")]:
        with pytest.raises(ValueError, match=f"admin token file .*{why}"):
            ServerConfig(admin_token_file=admin_token_file(tmp_path, token))
    with pytest.raises(ValueError, match="admin token file"):
        ServerConfig(admin_token_file=str(tmp_path / "absent"))
    assert ServerConfig(admin_token_file=admin_token_file(tmp_path, ADMIN)).admin_token() == ADMIN
    with pytest.raises(ValueError, match="tenant_source"):
        ServerConfig(tenant_source="cookie")


ADMIN = "a-long-enough-admin-token"


async def test_add_corpus_validates_its_tenant_and_yields_the_loop_while_inserting(tmp_path):
    token = ADMIN
    r = await start_server(admin_token_file=admin_token_file(tmp_path, token))
    auth = (("x-batchserve-admin-token", token),)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await r.stub.AddCorpus(pb.AddCorpusRequest(texts=["x"], tenant="no spaces"), metadata=auth)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant" in e.value.details()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        reply = await r.stub.AddCorpus(pb.AddCorpusRequest(texts=["abcdefgh" * 20] * 400, tenant="t1"), metadata=auth)
        t.cancel()
        assert reply.sequences == 400
        assert ticks > 20  # the loop ran other work between slices of the insert
    finally:
        await _stop(r)


async def test_a_port_in_use_is_one_line_naming_the_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for kwargs, flag in (({"http_port": port}, "--http-port"), ({"metrics_port": port}, "--metrics-port")):
            with pytest.raises(PortInUse) as e:
                await start_server(**kwargs)
            assert f"port {port} on 127.0.0.1 is in use" in str(e.value) and flag in str(e.value)
            assert "\n" not in str(e.value)


def test_serve_reports_a_port_in_use_in_one_line_before_loading_the_model(capsys, monkeypatch):
    from batchserve import cli

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load when a port is taken")

    monkeypatch.setattr("batchserve.engine.EngineCore.__init__", no_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(["serve", "--port", "0", "--http-port", str(port)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"batchserve serve: HTTP port {port} on 127.0.0.1 is in use (set another with --http-port")


@pytest.mark.parametrize(
    ("method", "raw"),
    [
        ("Generate", b"\x12\x04a\xed\xa0\x80"),  # text: a UTF-8-encoded lone surrogate
        ("StreamGenerate", b"\x12\x02\xff\xfe"),  # text: bytes that are no UTF-8 at all
        ("Tokenize", b"\x0a\x05abc"),  # a length past the message's end
    ],
)
async def test_a_grpc_request_that_does_not_parse_is_invalid_argument_naming_why(method, raw):
    r = await start_server()
    try:
        if method == "StreamGenerate":
            call = r.channel.unary_stream(f"/batchserve.v1.TextGeneration/{method}", lambda b: b, lambda b: b)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call(raw):
                    pass
        else:
            call = r.channel.unary_unary(f"/batchserve.v1.TextGeneration/{method}", lambda b: b, lambda b: b)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call(raw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in e.value.details()
        assert (await r.stub.Generate(build_request([1, 2], max_new_tokens=2))).token_ids  # the server goes on
    finally:
        await _stop(r)
