"""A forced tool call that max_tokens cuts short (issue 79, item 12) is still a call: its name and
its arguments as far as they got, finish_reason "length", never the chat template's markup; in
whole answers, streams and the Responses API."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchserve.server.openai.tool_grammar import HEAD
from tests.server.test_openai_api import _client, _raw, _sse_frames
from tests.server.test_openai_tool_calls import MAX_TOKENS, MODE, NAMED, USER
from tests.server.test_openai_tools import CALL, NOOP_CALL, tools_of

WEATHER_ARGS = '{"city": "Paris"}'


def test_a_named_call_cut_anywhere_is_that_call_as_far_as_it_got():
    named = tools_of({"type": "function", "function": {"name": "get_weather"}})
    for end in range(1, len(CALL) + 1):
        out = named.parse(CALL[:end])
        assert out.content is None and "<tool_call>" not in json.dumps(out.message())
        [call] = out.tool_calls
        assert call["function"]["name"] == "get_weather" and WEATHER_ARGS.startswith(call["function"]["arguments"])
        assert out.cut is (end < len(CALL))
        assert out.finish_reason("length") == "length"
        assert out.finish_reason("stop") == ("tool_calls" if end == len(CALL) else "stop")
    # Only the closing tags cut: the arguments are whole.
    assert named.parse(CALL[:-3]).tool_calls[0]["function"]["arguments"] == WEATHER_ARGS


def test_a_required_call_is_kept_once_its_name_is_told():
    required = tools_of("required")  # get_weather and noop: the name's first character tells them apart
    told = len(HEAD) + 2
    for end in range(1, len(CALL)):
        out = required.parse(CALL[:end])
        assert out.content is None
        assert [c["function"]["name"] for c in out.tool_calls] == (["get_weather"] if end >= told else [])
    # After whole calls: those, then the cut one (unless only one call is allowed).
    two = required.parse(f"{NOOP_CALL}\n{CALL[:-20]}")
    assert [c["function"]["name"] for c in two.tool_calls] == ["noop", "get_weather"] and two.cut
    assert two.tool_calls[1]["function"]["arguments"] == WEATHER_ARGS[: len(WEATHER_ARGS) - 6]
    one = tools_of("required", False).parse(f"{NOOP_CALL}\n{CALL[:-20]}")
    assert [c["function"]["name"] for c in one.tool_calls] == ["noop"] and not one.cut
    assert required.parse(f"{NOOP_CALL}\n").tool_calls[0]["function"]["name"] == "noop"


def test_auto_leaves_a_cut_block_as_content():
    # Nothing forced the call: an unfinished block may be anything the model wrote.
    out = tools_of("auto").parse(CALL[:-5])
    assert out.content == CALL[:-5] and out.tool_calls == ()


def test_a_streamed_forced_call_cut_short_sends_no_content():
    named = tools_of({"type": "function", "function": {"name": "get_weather"}})
    text = CALL[:40]
    stream = named.stream()
    assert "".join(stream.feed(ch) for ch in text) == ""
    tail = stream.flush()
    assert tail.content == "" and tail.parse.cut
    assert [(d["index"], d["function"]["name"]) for d in tail.tool_calls] == [(0, "get_weather")]


# ---- over HTTP, on the tiny model -------------------------------------------------------------


def _chat(max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, "tools": [MODE], "tool_choice": NAMED, "max_tokens": max_tokens,
            "temperature": 0, **fields}  # fmt: skip


@pytest.mark.parametrize("max_tokens", [3, 30, 50, 62])
async def test_a_forced_call_cut_by_max_tokens_plain_and_streamed(api, max_tokens):
    whole = (await _client(api).chat.completions.create(**_chat(MAX_TOKENS))).choices[0]
    full = whole.message.tool_calls[0].function.arguments  # greedy: the cut one is its beginning
    status, reply = await _raw(api, "POST", "/v1/chat/completions", _chat(max_tokens))
    assert status == 200
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "set_mode" and full.startswith(call["function"]["arguments"])
    assert call["id"].startswith("call_") and "<tool_call>" not in json.dumps(reply)
    frames = await _sse_frames(api, "/v1/chat/completions", _chat(max_tokens, stream=True))
    chunks = [json.loads(f)["choices"][0] for f in frames[:-1]]
    assert all(not c["delta"].get("content") for c in chunks)
    assert chunks[-1]["finish_reason"] == "length"
    [delta] = chunks[-1]["delta"]["tool_calls"]
    assert delta["function"] == {"name": "set_mode", "arguments": call["function"]["arguments"]}


async def test_a_responses_forced_call_cut_short_is_an_incomplete_function_call(api):
    tools = [{"type": "function", **MODE["function"]}]
    body = {"model": "tiny", "input": "go fast", "max_output_tokens": 50, "temperature": 0, "tools": tools,
            "tool_choice": {"type": "function", "name": "set_mode"}}  # fmt: skip
    status, reply = await _raw(api, "POST", "/v1/responses", body)
    assert status == 200 and reply["status"] == "incomplete"
    [item] = reply["output"]
    assert item["type"] == "function_call" and item["name"] == "set_mode" and item["status"] == "incomplete"
    assert "<tool_call>" not in json.dumps(reply)
