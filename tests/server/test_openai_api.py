"""The OpenAI-compatible HTTP API on a real server on loopback: the official `openai` client for
what works, raw HTTP for the error cases and a disconnect."""

from __future__ import annotations

import asyncio
import http.client
import json
from typing import Any

import openai
import pytest

from batchserve import SamplingParams
from batchserve.llm import LLM
from batchserve.request import FinishReason
from batchserve.server.client import build_request
from tests.server.conftest import start_server, tiny_core


@pytest.fixture
async def api():
    r = await start_server(http=True, metrics_port=0)
    yield r
    await r.channel.close()
    await r.server.shutdown()


def _client(r) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{r.server.http_port}/v1", api_key="unused", max_retries=0)


async def _raw(r, method: str, path: str, body: object = None, headers: dict | None = None) -> tuple[int, dict]:
    """One request over plain http.client (in a thread: the server runs on this loop)."""

    def call() -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", r.server.http_port, timeout=30)
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        return resp.status, json.loads(raw) if raw else {}

    return await asyncio.to_thread(call)


async def _until_idle(core: Any, seconds: float) -> None:
    """Wait until the engine has nothing running or waiting, at most `seconds`."""
    for _ in range(int(seconds / 0.02)):
        if not core.scheduler.has_work():
            return
        await asyncio.sleep(0.02)


async def _post_and_keep_open(r, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """POST /v1/completions on a raw connection the test closes when it likes (a client leaving)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", r.server.http_port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    return reader, writer


def _offline(prompt, params):
    return LLM.from_core(tiny_core()).generate([prompt], params)[0]


async def test_completions_and_chat_greedy_equal_grpc_and_llm(api):
    client = _client(api)
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    expected = _offline(prompt, params)
    grpc_reply = await api.stub.Generate(build_request(prompt, max_new_tokens=12, ignore_eos=True))
    done = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].text == expected.text == grpc_reply.text
    assert done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == 5 and done.usage.completion_tokens == 12
    speculation = done.usage.model_extra["speculation"]
    assert speculation["steps"] >= 1 and speculation["draft_tokens_accepted"] <= speculation["draft_tokens_proposed"]

    messages = [{"role": "user", "content": "hello there"}]
    chat = await client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=10, temperature=0
    )
    grpc_chat = await api.stub.Generate(build_request(messages, max_new_tokens=10))
    assert chat.choices[0].message.content == grpc_chat.text
    assert chat.choices[0].message.role == "assistant"
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_streaming_both_endpoints_with_usage_and_done(api):
    client = _client(api)
    prompt = "abc def"
    whole = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole_chat = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    stream = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    parts = [c async for c in stream]
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in parts) == whole_chat.choices[0].message.content


async def test_non_ascii_streams_without_broken_characters(api):
    """Byte-level tokens split multi-byte characters; every SSE chunk must still be whole text."""
    client = _client(api)
    text = "héllo wörld — ünïcödé ✓ 日本語"
    core = api.core
    ids = core.text.tokenize(text)
    # Seed sampling so the output wanders across byte tokens; the same call unstreamed is the truth.
    kw = dict(model="tiny", prompt=ids, max_tokens=40, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    whole = await client.completions.create(**kw)
    stream = await client.completions.create(**kw, stream=True)
    pieces = [c.choices[0].text async for c in stream if c.choices]
    assert "".join(pieces) == whole.choices[0].text
    assert all("\ufffd" not in p or "\ufffd" in whole.choices[0].text for p in pieces)


async def test_disconnect_mid_stream_frees_the_kv_at_once(api):
    core = api.core
    body = json.dumps(
        {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 400, "stream": True, "ignore_eos": True}
    ).encode()
    reader, writer = await _post_and_keep_open(api, body)
    await reader.readuntil(b"data: ")  # the first chunk arrived: the request runs
    assert core.scheduler.num_running == 1
    writer.close()
    await _until_idle(core, 4.0)
    assert not core.scheduler.has_work()
    alloc = core.scheduler.allocator
    assert alloc.num_free_blocks == alloc.num_blocks


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 2}, 400, "n"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 3}, 400, "logprobs"),
        ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, 400, None),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
         400, "tools"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, None),
        ("/v1/chat/completions",
         {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         400, "messages[0].content"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "lookahead": {"decoding_length": 99}}, 400, None),
    ],
)
async def test_errors_are_openai_error_objects_with_the_right_status(api, path, body, status, param):
    code, reply = await _raw(api, "POST", path, body)
    assert code == status, reply
    err = reply["error"]
    assert err["message"] and err["type"] and err["param"] == param
    ok, _ = await _raw(api, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert ok == 200  # still serving


async def test_too_large_body_is_413_and_malformed_json_is_400(api):
    huge = b'{"model": "tiny", "prompt": "' + b"a" * (api.server.max_message_bytes + 10) + b'"}'
    code, reply = await _raw(api, "POST", "/v1/completions", huge)
    assert code == 413 and reply["error"]["type"] == "request_too_large"
    code, reply = await _raw(api, "POST", "/v1/completions", b"{not json")
    assert code == 400 and "error" in reply

    def chunked(body: bytes) -> int:  # no Content-Length: the bound applies while reading
        conn = http.client.HTTPConnection("127.0.0.1", api.server.http_port, timeout=30)
        pieces = (body[i : i + 65536] for i in range(0, len(body), 65536))
        conn.request("POST", "/v1/completions", body=pieces, encode_chunked=True,
                     headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        status = conn.getresponse().status
        conn.close()
        return status

    assert await asyncio.to_thread(chunked, huge) == 413
    small = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2}).encode()
    assert await asyncio.to_thread(chunked, small) == 200


async def test_full_queue_is_429_and_draining_is_503(monkeypatch):
    r = await start_server(tiny_core(max_num_seqs=1), http=True, max_waiting_requests=1)
    try:
        monkeypatch.setattr(r.server.frontend, "_queue_full", lambda: True)
        code, reply = await _raw(r, "POST", "/v1/completions", {"model": "tiny", "prompt": "x"})
        assert code == 429 and reply["error"]["type"] == "rate_limit_error"
        monkeypatch.undo()
        assert (await _raw(r, "GET", "/health"))[0] == 200
        r.server.frontend.draining = True
        code, reply = await _raw(r, "POST", "/v1/chat/completions", {"model": "tiny", "messages": []})
        assert code in (400, 503)  # validation may answer first for a bad body
        code, reply = await _raw(r, "POST", "/v1/completions", {"model": "tiny", "prompt": "x"})
        assert code == 503 and reply["error"]["type"] == "service_unavailable"
        assert (await _raw(r, "GET", "/health"))[0] == 503
    finally:
        await r.channel.close()
        await r.server.shutdown()


async def test_engine_error_is_500(api, monkeypatch):
    runner = api.core.runner
    real, state = runner.execute, {"fail": True}

    def flaky(out):
        if state.pop("fail", False):
            raise RuntimeError("injected")
        return real(out)

    monkeypatch.setattr(runner, "execute", flaky)
    code, reply = await _raw(api, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3})
    assert code == 500 and "injected" in reply["error"]["message"]
    assert (await _raw(api, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3}))[0] == 200


async def test_tenant_header_and_user_scope_drafts_and_the_schema_is_served(api):
    code, schema = await _raw(api, "GET", "/openapi.json")
    assert code == 200 and "/v1/chat/completions" in schema["paths"]
    seen = []
    real = api.core.add_request

    def spy(prompt, params, request_id, tenant):
        seen.append(tenant)
        return real(prompt, params, request_id, tenant)

    api.core.add_request = spy
    await _raw(api, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "u1"})
    await _raw(api, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "u1"},
               headers={"x-batchserve-tenant": "t9"})
    assert seen == ["", "t9"]  # OpenAI's `user` is an end-user id, not a tenant key (by default)


async def test_shutdown_lets_an_http_stream_finish_then_refuses():
    r = await start_server(http=True, grace_seconds=30)
    client = _client(r)
    stream = await client.completions.create(
        model="tiny", prompt=[1, 2, 3], max_tokens=60, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    first = await anext(aiter(stream))
    stopping = asyncio.create_task(r.server.shutdown())
    while not r.server.frontend.draining:
        await asyncio.sleep(0.01)
    code, _ = await _raw(r, "POST", "/v1/completions", {"model": "tiny", "prompt": "x"})
    assert code == 503
    rest = [c async for c in stream]
    assert [c.choices[0].finish_reason for c in [first, *rest] if c.choices][-1] == "length"
    await stopping
    await r.channel.close()


async def test_a_client_that_leaves_a_whole_completion_frees_the_kv_too(api):
    core = api.core
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True}).encode()
    _, writer = await _post_and_keep_open(api, body)
    while not core.scheduler.num_running:
        await asyncio.sleep(0.01)
    req = core.scheduler.running[0]
    writer.close()
    await _until_idle(core, 10.0)
    assert not core.scheduler.has_work()
    assert req.finish_reason is FinishReason.CANCELLED and len(req.output_token_ids) < 400
    assert core.scheduler.allocator.num_free_blocks == core.scheduler.allocator.num_blocks
