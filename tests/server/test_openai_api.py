"""The OpenAI-compatible HTTP API on a real server on loopback: the official `openai` client for
what works, raw HTTP for the error cases and a disconnect."""

from __future__ import annotations

import asyncio
import http.client
import json
from dataclasses import replace
from typing import Any

import openai
import pytest

from batchserve import SamplingParams
from batchserve.llm import LLM
from batchserve.request import FinishReason
from batchserve.server.client import build_request
from tests.server.conftest import start_server, tiny_core


def _client(r, strict: bool = True) -> openai.AsyncOpenAI:
    """The official client; `strict`: every response must validate against its types, not just
    parse. Streamed legacy completions need strict off: the client types `finish_reason` as
    never null there, while OpenAI's own API (and ours) sends null until the last chunk."""
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{r.server.http_port}/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=strict,
    )


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


async def _post_and_keep_open(
    r, body: bytes, path: str = "/v1/completions"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """POST on a raw connection the test closes when it likes (a client leaving); the server
    closes it after the response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", r.server.http_port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n".encode()
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
    assert models.data[0].batch_invariant == api.server.engine.core.facts.batch_invariant  # our extension fields
    assert models.data[0].batch_invariant_why == api.server.engine.core.facts.invariance_why
    assert models.data[0].forward == api.server.engine.core.facts.forward.name
    assert models.data[0].weights_reason == api.server.engine.core.facts.forward.weights.why
    parts = models.data[0].forward_parts
    assert parts["weights"] == {"choice": "float32", "why": api.server.engine.core.facts.forward.weights.why}
    assert set(parts) == {"impl", "weights", "linear", "attention", "graphs", "fused"}


async def test_streaming_both_endpoints_with_usage_and_done(api):
    client, legacy = _client(api), _client(api, strict=False)
    prompt = "abc def"
    whole = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    stream = await legacy.completions.create(
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
    stream = await _client(api, strict=False).completions.create(**kw, stream=True)
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
    req = core.scheduler.running[0]
    writer.close()
    await _until_idle(core, 4.0)
    assert not core.scheduler.has_work()
    # Cancelled by the disconnect, not finished by running out of tokens.
    assert req.finish_reason is FinishReason.CANCELLED and len(req.output_token_ids) < 400
    alloc = core.scheduler.allocator
    assert alloc.num_free_blocks == alloc.num_blocks


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 9}, 400, "n"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 9}, 400, "best_of"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"model": "tiny", "prompt": ["a"] * 5, "n": 2}, 400, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, 400, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
            400,
            "tools[0].type",
        ),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, None),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "messages[0].content",
        ),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "lookahead": {"decoding_length": 99}}, 400, "lookahead"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "resume_token_ids": [99999]}, 400, "resume_token_ids"),
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
        conn.request(
            "POST",
            "/v1/completions",
            body=pieces,
            encode_chunked=True,
            headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
        )
        status = conn.getresponse().status
        conn.close()
        return status

    assert await asyncio.to_thread(chunked, huge) == 413
    small = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2}).encode()
    assert await asyncio.to_thread(chunked, small) == 200


async def test_full_queue_is_429_and_draining_is_503(monkeypatch):
    r = await start_server(tiny_core(max_num_seqs=1), http=True, max_waiting_requests=1)
    try:
        monkeypatch.setattr(r.server.frontend, "_queue_excess", lambda count=1: count)
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
    real, state = runner.launch, {"fail": True}

    def flaky(out):
        if state.pop("fail", False):
            raise RuntimeError("injected")
        return real(out)

    monkeypatch.setattr(runner, "launch", flaky)
    code, reply = await _raw(api, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3})
    assert code == 500 and "injected" in reply["error"]["message"]
    assert (await _raw(api, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 3}))[0] == 200


async def test_tenant_header_and_user_scope_drafts_and_the_schema_is_served(api):
    code, schema = await _raw(api, "GET", "/openapi.json")
    assert code == 200 and "/v1/chat/completions" in schema["paths"]
    seen = []
    real = api.core.add_request

    def spy(sub):
        seen.append(sub.tenant)
        return real(sub)

    api.core.add_request = spy
    await _raw(api, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "u1"})
    await _raw(
        api,
        "POST",
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "u1"},
        headers={"x-batchserve-tenant": "t9"},
    )
    assert seen == ["", "t9"]  # OpenAI's `user` is an end-user id, not a tenant key (by default)


async def test_shutdown_lets_an_http_stream_finish_then_refuses():
    r = await start_server(http=True, grace_seconds=30)
    client = _client(r, strict=False)  # streams a legacy completion
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


async def _sse_frames(r, path: str, body: dict) -> list[str]:
    """The raw `data:` payloads of one streamed call, in order."""
    reader, writer = await _post_and_keep_open(r, json.dumps(body).encode(), path)
    raw = await reader.read()
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"text/event-stream" in head
    if b"chunked" in head.lower():  # undo the transfer encoding
        data, rest = b"", rest
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            data, rest = data + rest[:n], rest[n + 2 :]
        rest = data
    events = rest.decode().split("\n\n")
    assert events[-1] == ""  # every event ends with a blank line
    assert all(e.startswith("data: ") for e in events[:-1])
    return [e.removeprefix("data: ") for e in events[:-1]]


async def test_the_sse_wire_format_frame_by_frame(api):
    frames = await _sse_frames(
        api,
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        },
    )
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "choices", "usage"}
        assert c["object"] == "chat.completion.chunk" and c["model"] == "tiny" and isinstance(c["created"], int)
    first, *middle, finish, usage = chunks
    assert (
        first["choices"]
        == [{"index": 0, "finish_reason": None, "logprobs": None, "delta": {"role": "assistant", "content": ""}}]
        and first["usage"] is None
    )
    for c in middle:
        assert c["usage"] is None and c["choices"][0]["finish_reason"] is None
        assert set(c["choices"][0]["delta"]) == {"content"}
    assert finish["choices"][0]["finish_reason"] == "length" and finish["usage"] is None
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5

    frames = await _sse_frames(
        api, "/v1/completions", {"model": "tiny", "prompt": "ab", "max_tokens": 3, "stream": True, "ignore_eos": True}
    )
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert all(set(c) == {"id", "object", "created", "model", "choices"} for c in chunks)  # no usage unasked
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_openai_defaults_max_tokens_to_the_rest_of_the_context_and_refuses_what_cannot_fit():
    core = tiny_core()
    core.facts = replace(core.facts, max_model_len=40)  # a short context: the default runs to its end
    core.text.max_model_len = 40
    r = await start_server(core, http=True)
    try:
        code, reply = await _raw(
            r, "POST", "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "temperature": 0, "ignore_eos": True}
        )
        assert code == 200 and reply["usage"]["completion_tokens"] == 37
        assert reply["choices"][0]["finish_reason"] == "length"
        code, reply = await _raw(r, "POST", "/v1/completions", {"model": "tiny", "prompt": [1] * 30, "max_tokens": 11})
        assert code == 400
        assert "30 tokens plus max_tokens 11 exceed the model's context of 40" in reply["error"]["message"]
        code, _ = await _raw(r, "POST", "/v1/completions", {"model": "tiny", "prompt": [1] * 30, "max_tokens": 10})
        assert code == 200
    finally:
        await r.channel.close()
        await r.server.shutdown()


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/v1/nope", None, 404),
        ("GET", "/v1/completions", None, 405),
        ("POST", "/v1/completions", b"{not json", 400),
        ("POST", "/v1/completions", b"[1, 2]", 400),
    ],
)
async def test_routing_and_parse_errors_are_openai_error_objects(api, method, path, body, status):
    code, reply = await _raw(api, method, path, body)
    assert code == status
    assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["message"] and reply["error"]["type"]


async def test_the_developer_role_is_a_system_message(api):
    client = _client(api)
    asked = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    same = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    a = await client.chat.completions.create(model="tiny", messages=asked, max_tokens=6, temperature=0)
    b = await client.chat.completions.create(model="tiny", messages=same, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
