"""The last 500s at the HTTP door: a lone surrogate in any text field (JSON lets `\\ud800` through,
no tokenizer takes it) is a 400 naming the field, and anything that escapes every handler is an
OpenAI error object, the server going on."""

from __future__ import annotations

from batchserve.server.openai.api import OpenAIServer
from batchserve.server.openai.bodies import MAX_OUTPUT_LOGPROBS
from batchserve.server.openai.calls import _first_bad
from tests.server.conftest import start_server
from tests.server.test_openai_api import _raw

LONE = '"\\ud800"'  # a JSON string of one unpaired surrogate escape
TOOL = '{"type": "function", "function": {"name": "f", "description": %s, "parameters": {"type": "object"}}}'
CASES = [
    ("/v1/completions", '{"model": "tiny", "prompt": %s}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", %s]}', "prompt[1]"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": %s}]}', "messages[0].content"),
    (
        "/v1/chat/completions",
        '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "prediction": {"type": "content",'
        ' "content": %s}}',
        "prediction.content",
    ),
    ("/v1/responses", '{"model": "tiny", "input": %s}', "input"),
    (
        "/v1/chat/completions",
        '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [' + TOOL + "]}",
        "tools[0].function.description",
    ),
]


def test_the_first_bad_string_is_named_by_its_path():
    assert _first_bad({"a": [1, "ok", {"b": "\ud800"}]}, "") == "a[2].b"
    assert _first_bad({"a": "ok", "\udc00": 1}, "") == "\udc00" and _first_bad("fine \U0001f600", "") is None


async def test_a_lone_surrogate_in_any_text_field_is_a_400_naming_it():
    r = await start_server(http=True)
    try:
        for path, template, param in CASES:
            code, reply = await _raw(r, "POST", path, (template % LONE).encode())
            assert code == 400, (path, param, reply)
            assert reply["error"]["param"] == param and "UTF-8" in reply["error"]["message"], reply
        paired = '{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 2}'  # a pair is one character
        assert (await _raw(r, "POST", "/v1/completions", paired.encode()))[0] == 200
        assert r.server.engine.dead is None
    finally:
        await r.channel.close()
        await r.server.shutdown()


async def test_an_unexpected_error_is_an_openai_error_object_and_the_server_goes_on(monkeypatch):
    r = await start_server(http=True)

    def broken(self):
        raise RuntimeError("a bug")

    try:
        monkeypatch.setattr(OpenAIServer, "_model_card", broken)
        code, reply = await _raw(r, "GET", "/v1/models")
        assert code == 500 and reply["error"]["type"] == "server_error" and "RuntimeError" in reply["error"]["message"]
        monkeypatch.undo()
        assert (await _raw(r, "GET", "/v1/models"))[0] == 200
    finally:
        await r.channel.close()
        await r.server.shutdown()


async def test_a_body_that_is_not_json_is_the_routes_own_400():
    r = await start_server(http=True)
    try:
        for body in [b"", b"not json \\ud800", b'{"prompt": "\\ud800"']:
            code, reply = await _raw(r, "POST", "/v1/completions", body)
            assert code == 400 and "error" in reply, (body, reply)
    finally:
        await r.channel.close()
        await r.server.shutdown()


async def test_asking_for_padded_stream_events_is_refused_not_ignored():
    """No padding is added, so a client asking for it is told so (a 400), not left to believe it."""
    r = await start_server(http=True)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
    try:
        for path, body, param in [
            ("/v1/chat/completions", {**chat, "stream_options": {"include_obfuscation": True}}, "stream_options"),
            ("/v1/responses", {"model": "tiny", "input": "x", "stream_options": {"include_obfuscation": True}}, None),
        ]:
            code, reply = await _raw(r, "POST", path, body)
            assert code == 400 and "no padding" in reply["error"]["message"], reply
            assert param is None or reply["error"]["param"].startswith(param)
        body = {**chat, "stream": False, "stream_options": {"include_obfuscation": False}}
        assert (await _raw(r, "POST", "/v1/chat/completions", body))[0] == 200
    finally:
        await r.channel.close()
        await r.server.shutdown()


async def test_output_logprobs_are_bounded_per_call_before_anything_is_queued():
    r = await start_server(http=True)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 20}
    try:
        # 8 samples x the whole context x 21: far past the bound, and nothing runs for it.
        code, reply = await _raw(r, "POST", "/v1/chat/completions", {**chat, "n": 8, "max_tokens": 100_000})
        assert code == 400 and reply["error"]["param"] == "max_tokens" and "logprobs" in reply["error"]["message"]
        # Without max_tokens the bound counts the whole context.
        body = {"model": "tiny", "prompt": "x", "logprobs": 5, "n": 8}
        code, reply = await _raw(r, "POST", "/v1/completions", body)
        over = 8 * r.core.facts.max_model_len * 6 > MAX_OUTPUT_LOGPROBS
        assert code == (400 if over else 200), reply
        code, _ = await _raw(r, "POST", "/v1/chat/completions", {**chat, "n": 2, "max_tokens": 3})
        assert code == 200
    finally:
        await r.channel.close()
        await r.server.shutdown()
