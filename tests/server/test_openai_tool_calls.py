"""Tool calling end to end over HTTP on the tiny model: the official `openai` client, plain and
streamed, for every tool_choice; a tool-call history reaching the prompt; bad values refused
before anything is queued; a langchain-openai round trip."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from batchserve.server.openai.tool_grammar import MAX_FORCED_CALLS
from tests.server.test_openai_api import _client, _raw, _sse_frames

try:
    import jsonschema
except ImportError:  # checked by hand below
    jsonschema = None

MODE_SCHEMA = {
    "type": "object",
    "properties": {"mode": {"enum": ["fast", "slow"]}, "level": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["mode", "level"],
    "additionalProperties": False,
}
COLOR_SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
SCHEMAS = {"set_mode": MODE_SCHEMA, "pick_color": COLOR_SCHEMA}
MODE = {"type": "function", "function": {"name": "set_mode", "description": "Set the mode", "parameters": MODE_SCHEMA}}
COLOR = {"type": "function", "function": {"name": "pick_color", "parameters": COLOR_SCHEMA}}
NAMED = {"type": "function", "function": {"name": "set_mode"}}
USER = [{"role": "user", "content": "go fast"}]
# Enough for a forced call to finish (short values only: enums, one digit): ~90 tokens each.
MAX_TOKENS = 128
RESULT = "mode is now FAST-42"  # a tool's result, to find in the prompt
PAST_CALL = {"id": "call_7", "type": "function", "function": {"name": "set_mode", "arguments": '{"mode": "fast"}'}}
HISTORY = [
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [PAST_CALL]},
    {"role": "tool", "tool_call_id": "call_7", "content": RESULT},
]


class SetMode(BaseModel):
    """Set the machine's mode (a langchain tool: the schema is this model's)."""

    mode: Literal["fast", "slow"]
    level: int = Field(ge=1, le=9)


def valid(name: str, arguments: str) -> dict[str, Any]:
    """A call's arguments, parsed and checked against its function's schema."""
    args = json.loads(arguments)
    schema = SCHEMAS[name]
    if jsonschema is not None:
        jsonschema.validate(args, schema)
        return args
    props = schema["properties"]
    assert set(schema["required"]) <= set(args) <= set(props)
    for key, value in args.items():
        if "enum" in props[key]:
            assert value in props[key]["enum"]
        else:
            assert type(value) is int and props[key]["minimum"] <= value <= props[key]["maximum"]
    return args


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """A whole answer's tool calls as (name, valid arguments), after checking their shape."""
    out = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        out.append((call.function.name, valid(call.function.name, call.function.arguments)))
    return out


async def streamed(client: Any, **kwargs: Any) -> dict[int, dict[str, Any]]:
    """A streamed answer per choice: its content, its calls reassembled from `delta.tool_calls`
    (as a client does: id, type and name once, arguments concatenated), its finish reasons."""
    stream = await client.chat.completions.create(stream=True, **kwargs)
    choices: dict[int, dict[str, Any]] = {}
    async for chunk in stream:
        for c in chunk.choices:
            state = choices.setdefault(c.index, {"content": "", "calls": {}, "finish": []})
            state["content"] += c.delta.content or ""
            state["finish"].append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                call = state["calls"].setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    for state in choices.values():
        assert all(f is None for f in state["finish"][:-1])  # a finish reason on the last chunk only
        calls = [state["calls"][i] for i in sorted(state["calls"])]
        assert all(c["id"].startswith("call_") for c in calls)
        state["calls"] = [(c["name"], valid(c["name"], c["arguments"])) for c in calls]
    return choices


@pytest.fixture
def prompts(api) -> list[str]:
    """The text of every prompt the engine is given (the tiny tokenizer's ids are bytes)."""
    seen: list[str] = []
    real = api.core.add_request

    def spy(sub):
        seen.append(bytes(sub.prompt).decode("utf-8", errors="replace"))
        return real(sub)

    api.core.add_request = spy
    return seen


async def test_a_named_function_is_called_plain_and_streamed(api):
    client = _client(api)
    kwargs = dict(model="tiny", messages=USER, tools=[MODE, COLOR], tool_choice=NAMED, max_tokens=MAX_TOKENS,
                  temperature=0)  # fmt: skip
    done = await client.chat.completions.create(**kwargs)
    [choice] = done.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, args)] = calls_of(choice.message)
    assert name == "set_mode"
    [s] = (await streamed(client, **kwargs)).values()
    assert s["calls"] == [(name, args)] and s["content"] == "" and s["finish"][-1] == "tool_calls"
    # On the wire: the role, then one chunk with the calls and the finish reason, then [DONE].
    frames = await _sse_frames(api, "/v1/chat/completions", {**kwargs, "stream": True})
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f)["choices"][0] for f in frames[:-1]]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["finish_reason"] == "tool_calls" and set(chunks[-1]["delta"]) == {"tool_calls"}
    [delta] = chunks[-1]["delta"]["tool_calls"]
    assert delta["index"] == 0 and delta["type"] == "function" and delta["function"]["name"] == "set_mode"
    assert json.loads(delta["function"]["arguments"]) == args
    assert all(not c["delta"].get("content") for c in chunks)


@pytest.mark.parametrize("parallel", [False, True])
async def test_required_calls_one_or_more_functions(api, parallel):
    client = _client(api)
    kwargs = dict(model="tiny", messages=USER, tools=[MODE, COLOR], tool_choice="required",
                  parallel_tool_calls=parallel, max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
    done = await client.chat.completions.create(**kwargs)
    [choice] = done.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = calls_of(choice.message)
    assert len(calls) == 1 if not parallel else 1 <= len(calls) <= MAX_FORCED_CALLS
    [s] = (await streamed(client, **kwargs)).values()
    assert s["calls"] == calls and s["content"] == "" and s["finish"][-1] == "tool_calls"


async def test_none_and_auto_answer_well_formed(api, prompts):
    client = _client(api)
    kwargs = dict(model="tiny", messages=USER, tools=[MODE], max_tokens=24, temperature=0)
    none = await client.chat.completions.create(tool_choice="none", **kwargs)
    assert none.choices[0].message.tool_calls is None and isinstance(none.choices[0].message.content, str)
    assert none.choices[0].finish_reason in ("stop", "length")
    assert "set_mode" not in prompts[-1]  # "none": the tools are not offered
    for choice in ("auto", None):  # auto is the default with tools
        done = await client.chat.completions.create(**({"tool_choice": choice} if choice else {}), **kwargs)
        assert "set_mode" in prompts[-1]
        message, finish = done.choices[0].message, done.choices[0].finish_reason
        calls = calls_of(message)  # whatever the random model wrote: content, calls, or both
        assert isinstance(message.content, str) or calls
        assert finish == "tool_calls" if calls and finish != "length" else finish in ("stop", "length")
        [s] = (await streamed(client, **({"tool_choice": choice} if choice else {}), **kwargs)).values()
        assert s["content"] == (message.content or "") and s["calls"] == calls and s["finish"][-1] == finish


async def test_a_tool_call_history_reaches_the_prompt(api, prompts):
    client = _client(api)
    done = await client.chat.completions.create(model="tiny", messages=HISTORY, tools=[MODE], max_tokens=4)
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    as_rendered = [*USER, {**HISTORY[1], "content": ""}, HISTORY[2]]  # ChatMessage.rendered: None is ""
    expected = bytes(api.core.text.render_chat(as_rendered, [MODE])).decode("utf-8", errors="replace")
    assert prompts == [expected]
    assert RESULT in expected and '"arguments": {"mode": "fast"}' in expected and "set_mode" in expected


async def test_n_samples_each_call_the_named_function(api):
    client = _client(api)
    kwargs = dict(model="tiny", messages=USER, tools=[MODE], tool_choice=NAMED, max_tokens=MAX_TOKENS, n=2,
                  temperature=1.0, seed=5)  # fmt: skip
    done = await client.chat.completions.create(**kwargs)
    assert [c.index for c in done.choices] == [0, 1]
    for c in done.choices:
        assert c.finish_reason == "tool_calls" and [name for name, _ in calls_of(c.message)] == ["set_mode"]
    choices = await streamed(client, **kwargs)
    assert sorted(choices) == [0, 1]
    for s in choices.values():
        assert [name for name, _ in s["calls"]] == ["set_mode"] and s["finish"][-1] == "tool_calls"


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, "max_tokens": 4, **fields}


BIG = {"type": "function", "function": {"name": "big", "parameters": {
    "type": "object", "properties": {"v": {"enum": [f"value{i:05d}" for i in range(8000)]}}}}}  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (_body(tools={"type": "function"}), "tools", "must be a list"),
        (_body(tools=[{"type": "function", "function": {"name": "set mode"}}]), "tools[0].function.name", "letters"),
        (_body(tools=[MODE], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice.function.name", "not in tools"),
        (_body(tool_choice="required"), "tool_choice", "needs tools"),
        (_body(tools=[MODE], tool_choice="sometimes"), "tool_choice", "must be none, auto"),
        (_body(tools=[MODE], parallel_tool_calls="yes"), "parallel_tool_calls", "boolean"),
        (_body(tools=[MODE], response_format={"type": "grammar", "grammar": 'start: "x"'}),
         "response_format", "cannot stand beside tools"),
        (_body(tools=[MODE, BIG]), "tools", "their schemas take"),  # over max_constraint_chars (65536)
    ],
)  # fmt: skip
async def test_bad_tool_values_are_400s_naming_the_field_and_queue_nothing(api, prompts, body, param, says):
    code, reply = await _raw(api, "POST", "/v1/chat/completions", body)
    assert code == 400 and reply["error"]["param"] == param and says in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert prompts == [] and not api.core.scheduler.has_work()


async def test_a_langchain_round_trip(api, prompts, monkeypatch):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    for var in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY"):
        monkeypatch.delenv(var, raising=False)  # nothing sent anywhere but our server

    llm = langchain_openai.ChatOpenAI(
        base_url=f"http://127.0.0.1:{api.server.http_port}/v1", api_key="x", model="tiny", temperature=0,
        max_tokens=MAX_TOKENS, max_retries=0, timeout=60,
    )  # fmt: skip
    messages: list[Any] = [HumanMessage("Make it fast.")]
    forced = llm.bind_tools([SetMode], tool_choice="SetMode", strict=True)  # strict: no other properties
    reply = await asyncio.to_thread(forced.invoke, messages)
    assert isinstance(reply, AIMessage) and reply.response_metadata["finish_reason"] == "tool_calls"
    [call] = reply.tool_calls
    assert call["name"] == "SetMode" and call["id"].startswith("call_")
    SetMode.model_validate(call["args"])
    assert call["args"]["mode"] in ("fast", "slow")
    messages += [reply, ToolMessage(RESULT, tool_call_id=call["id"])]
    final = await asyncio.to_thread(llm.invoke, messages)
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert isinstance(final.content, str) and final.content
    assert RESULT in prompts[-1] and RESULT not in prompts[0]
    assert json.dumps(call["args"]) in prompts[-1]  # the call it made is in the history it sent back
