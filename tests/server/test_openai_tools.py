"""OpenAI tool calling's pieces: request checks, prompts with tools, the forcing grammar, parsing, streaming."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchserve.config import LimitsConfig
from batchserve.grammar import GrammarCompiler, GrammarError, allows
from batchserve.request import Constraint
from batchserve.server.openai.errors import ApiError
from batchserve.server.openai.tool_grammar import MAX_FORCED_CALLS
from batchserve.server.openai.tools import MAX_TOOLS, ChatTools, parse_tool_request
from batchserve.text import TextCodec, tools_prompt
from tests.conftest import TINY_VOCAB, make_tiny_tokenizer
from tests.server.conftest import CHAT_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
            "required": ["city"],
            "additionalProperties": False,
            "$defs": {"unit": {"enum": ["C", "F"]}},
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}  # no parameters: no arguments
TOOLS = [WEATHER, NOOP]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NOOP_CALL = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'


def tools_of(tool_choice: Any = None, parallel: Any = None, tools: Any = TOOLS, max_chars: int = 65536) -> ChatTools:
    out = parse_tool_request(tools, tool_choice, parallel, max_chars)
    assert out is not None
    return out


def with_function(**fields: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", **fields}}]


# ---- request checks -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "param"),
    [
        ("get_weather", None, None, "tools"),
        ([NOOP] * (MAX_TOOLS + 1), None, None, "tools"),
        ([1], None, None, "tools[0]"),
        ([{"type": "retrieval", "function": {"name": "f"}}], None, None, "tools[0].type"),
        ([{"type": "function"}], None, None, "tools[0].function"),
        ([{"type": "function", "function": {"name": "f"}, "x": 1}], None, None, "tools[0].x"),
        (with_function(color="red"), None, None, "tools[0].function.color"),
        ([{"type": "function", "function": {"name": "get weather"}}], None, None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f" * 65}}], None, None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": 7}}], None, None, "tools[0].function.name"),
        ([NOOP, WEATHER, NOOP], None, None, "tools[2].function.name"),
        (with_function(description=3), None, None, "tools[0].function.description"),
        (with_function(parameters=["x"]), None, None, "tools[0].function.parameters"),
        (with_function(parameters={"type": "string"}), None, None, "tools[0].function.parameters"),
        (with_function(strict="yes"), None, None, "tools[0].function.strict"),
        (TOOLS, "sometimes", None, "tool_choice"),
        (TOOLS, {"type": "function"}, None, "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "noop"}, "x": 1}, None, "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice.function.name"),
        (TOOLS, {"type": "function", "function": {"id": "noop"}}, None, "tool_choice.function.name"),
        (None, "auto", None, "tool_choice"),
        ([], "required", None, "tool_choice"),
        (None, {"type": "function", "function": {"name": "noop"}}, None, "tool_choice.function.name"),
        (TOOLS, None, "yes", "parallel_tool_calls"),
        (TOOLS, None, 1, "parallel_tool_calls"),
    ],
)
def test_every_bad_tool_field_is_a_400_naming_it(tools, choice, parallel, param):
    with pytest.raises(ApiError) as e:
        parse_tool_request(tools, choice, parallel, 65536)
    assert e.value.status == 400 and e.value.param == param
    assert param.split("[")[0].split(".")[0] in e.value.message


def test_the_tools_schemas_are_bounded_by_the_constraint_limit():
    # The bound is the grammar forcing a call of any of them: no constraint they make is larger.
    forced = tools_of("required", max_chars=2000).constraint(None)
    assert forced is not None and len(forced.spec) <= 2000
    with pytest.raises(ApiError, match=r"tools: their schemas take \d+ characters, at most 300") as e:
        parse_tool_request(TOOLS, "auto", None, 300)
    assert e.value.param == "tools"
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ApiError, match="nested deeper than") as e:
        parse_tool_request(with_function(parameters=deep), None, None, 10**9)
    assert e.value.param == "tools[0].function.parameters"


def test_defaults_and_neutral_values():
    assert parse_tool_request(None, None, None, 100) is None
    assert parse_tool_request([], "none", False, 100) is None
    auto = tools_of()
    assert (auto.choice, auto.function, auto.parallel) == ("auto", None, True)
    assert [t.name for t in auto.tools] == ["get_weather", "noop"] and auto.prompt_tools == TOOLS
    assert auto.tools[1].parameters["properties"] == {}  # omitted: a function without arguments
    assert tools_of("none").prompt_tools is None  # "none": the model is not offered them
    named = tools_of({"type": "function", "function": {"name": "noop"}}, parallel=False)
    assert (named.choice, named.function, named.parallel, named.forced) == ("function", "noop", False, True)
    assert tools_of("required").forced and not auto.forced


# ---- prompts --------------------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]
# A template that renders tools itself (the shape of a tools-trained model's). Newlines as
# expressions: transformers' jinja drops the one after a block tag.
TOOLS_TEMPLATE = (
    "{% if tools %}[tools:{% for t in tools %} {{ t.function.name }}{% endfor %}]\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}{{ '\\n' }}{% endfor %}<assistant>"
)


def codec(template: str = CHAT_TEMPLATE, **limits: int) -> TextCodec:
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = template
    return TextCodec(tokenizer, TINY_VOCAB, max_model_len=1024, limits=LimitsConfig(**limits))


def rendered(c: TextCodec, messages: list[dict[str, Any]], tools: Any = None) -> str:
    return bytes(c.render_chat(messages, tools)).decode()


def test_a_template_without_tools_gets_them_as_text():
    text = rendered(codec(), HISTORY, TOOLS)
    functions = "\n".join(json.dumps(t["function"]) for t in TOOLS)
    assert text == (
        f"<system>{tools_prompt(TOOLS)}\n"
        "<user>Weather in Paris?\n"
        f"<assistant>{CALL}\n"
        "<user><tool_response>\n22C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>\n"
        "<assistant>"
    )
    assert functions in tools_prompt(TOOLS) and "<tool_call>" in tools_prompt(TOOLS)
    # A system message of the client's own keeps its text first; an assistant's text stays before its calls.
    first = [{"role": "developer", "content": "Be brief."}, {**HISTORY[1], "content": "Checking."}]
    assert rendered(codec(), first, TOOLS).startswith(f"<system>Be brief.\n\n{tools_prompt(TOOLS)}\n")
    assert f"<assistant>Checking.\n{CALL}\n" in rendered(codec(), first, TOOLS)
    # Without tools (tool_choice "none"), past calls and results still render, with no tool list.
    assert rendered(codec(), HISTORY).startswith("<user>Weather in Paris?\n<assistant><tool_call>")


def test_a_tools_aware_template_gets_tools_and_tool_messages_as_they_are():
    text = rendered(codec(TOOLS_TEMPLATE), HISTORY, TOOLS)
    assert text == (
        "[tools: get_weather noop]\n"
        "<user>Weather in Paris?\n"
        '<assistant>[call get_weather {"city": "Paris"}]\n'  # the arguments as an object
        "<tool>22C[for call_1]\n<tool>sunny[for call_2]\n<assistant>"
    )


def test_tool_calls_and_schemas_count_against_the_chat_bounds():
    small = codec(max_prompt_chars_per_token=1)  # 1024 characters before templating
    big_call = {**HISTORY[1], "tool_calls": [{"function": {"name": "f", "arguments": json.dumps({"a": "x" * 1100})}}]}
    with pytest.raises(ValueError, match=r"input.chat: \d+ characters cannot fit"):
        small.render_chat([big_call])
    big_tool = with_function(description="x" * 1100)
    with pytest.raises(ValueError, match=r"input.chat: \d+ characters cannot fit"):
        small.render_chat([{"role": "user", "content": "hi"}], big_tool)


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        ({"role": "user", "content": "hi", "tool_calls": []}, r"messages\[0\].tool_calls"),
        ({"role": "assistant", "tool_calls": {"name": "f"}}, r"messages\[0\].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"function": {}}]}, r"tool_calls\[0\].function.name"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}, "arguments"),
        ({"role": "tool", "content": ["part"]}, r"messages\[0\].content"),
        ({"role": "function", "content": "x"}, "role"),
    ],
)
def test_malformed_tool_messages_are_refused(message, problem):
    with pytest.raises(ValueError, match=problem):
        codec().render_chat([message])


# ---- the forcing grammar ------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(make_tiny_tokenizer(), TINY_VOCAB, max_chars=65536)


def accepts(compiler: GrammarCompiler, constraint: Constraint | None, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end there."""
    assert constraint is not None and constraint.kind == "grammar"
    g = compiler.matcher(compiler.compile(constraint))
    try:
        g.commit(list(text.encode()))  # the tiny tokenizer's ids are the bytes
    except GrammarError:
        return False
    return allows(g.prune(None)[1][0], g.eos_token_id)


TWO_CALLS = f"{CALL}\n{NOOP_CALL}"


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "ok"),
    [
        ("required", None, CALL, True),
        ("required", None, TWO_CALLS, True),
        ("required", None, CALL.replace('"Paris"}', '"Paris", "unit": "F"}'), True),  # through its $ref
        ("required", None, CALL.replace('"Paris"}', '"Paris", "unit": "K"}'), False),
        ("required", None, CALL.replace('"Paris"', "7"), False),  # a number where the schema wants a string
        ("required", None, CALL.replace('{"city": "Paris"}', "{}"), False),  # a required argument missing
        ("required", None, CALL.replace("get_weather", "get_time"), False),  # no such function
        ("required", None, NOOP_CALL.replace("{}", '{"x": 1}'), False),  # no arguments allowed
        ("required", None, "Sure. " + CALL, False),  # only calls
        ("required", None, CALL[:-3], False),  # unfinished
        ("required", None, CALL.replace('{"name": ', '{"name":'), False),  # json.dumps' layout only
        ("required", None, CALL + "\n", True),  # a newline may end it (before the end of turn)
        ("required", None, CALL + "\n\n", False),
        ("required", False, CALL, True),
        ("required", False, CALL + "\n", True),
        ("required", False, TWO_CALLS, False),
        ({"type": "function", "function": {"name": "noop"}}, None, NOOP_CALL, True),
        ({"type": "function", "function": {"name": "noop"}}, None, CALL, False),
        ({"type": "function", "function": {"name": "noop"}}, None, f"{NOOP_CALL}\n{NOOP_CALL}", False),
    ],
)
def test_forced_calls_compile_and_take_only_valid_calls(compiler, choice, parallel, text, ok):
    assert accepts(compiler, tools_of(choice, parallel).constraint(None), text) is ok


def test_forced_parallel_calls_are_bounded(compiler):
    # A small model that repeats its call stops at the bound instead of filling max_tokens.
    required = tools_of("required").constraint(None)
    calls = [CALL, NOOP_CALL] * MAX_FORCED_CALLS
    assert accepts(compiler, required, "\n".join(calls[:MAX_FORCED_CALLS]))
    assert accepts(compiler, required, "\n".join(calls[:MAX_FORCED_CALLS]) + "\n")
    assert not accepts(compiler, required, "\n".join(calls[: MAX_FORCED_CALLS + 1]))
    # A newline after the last call but one may begin another call; after the last, only the end.
    assert required is not None
    for count, more in [(MAX_FORCED_CALLS - 1, True), (MAX_FORCED_CALLS, False)]:
        g = compiler.matcher(compiler.compile(required))
        g.commit(list(("\n".join(calls[:count]) + "\n").encode()))
        mask = g.prune(None)[1][0]
        assert allows(mask, ord("<")) is more and allows(mask, g.eos_token_id)


def test_the_constraint_forces_calls_joins_a_format_under_auto_and_leaves_the_rest_free():
    fmt = Constraint("json_object")
    assert tools_of("auto").constraint(None) is None and tools_of("none").constraint(None) is None
    assert tools_of("none").constraint(fmt) is fmt  # no tools offered: the format alone
    union = tools_of("auto").constraint(fmt)
    assert union.kind == "grammar" and union.spec.startswith("start: calls | answer")
    forced = tools_of("required").constraint(fmt)  # the format is the next turn's
    assert forced == tools_of("required").constraint(None)
    with pytest.raises(ApiError) as e:
        tools_of("auto").constraint(Constraint("grammar", 'start: "x"'))
    assert e.value.param == "response_format"


# ---- parsing --------------------------------------------------------------------------------


def arguments(call: dict[str, Any]) -> dict[str, Any]:
    return json.loads(call["function"]["arguments"])


def test_calls_are_parsed_out_of_the_text():
    out = tools_of().parse(f"Let me check.\n{CALL}\n{NOOP_CALL}\n")
    assert out.content == "Let me check." and [c["function"]["name"] for c in out.tool_calls] == ["get_weather", "noop"]
    assert arguments(out.tool_calls[0]) == {"city": "Paris"} and arguments(out.tool_calls[1]) == {}
    ids = [c["id"] for c in out.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert out.tool_calls[0]["type"] == "function"
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    assert out.message()["tool_calls"] == list(out.tool_calls)
    only = tools_of("required").parse(CALL)
    assert only.content is None and only.message()["content"] is None
    assert len(tools_of(parallel=False).parse(TWO_CALLS).tool_calls) == 1
    # Forced calls cut short by max_tokens: the complete ones and the cut one, no content, "length" stays.
    cut = tools_of("required").parse(f"{CALL}\n{CALL[:-1]}")
    assert cut.content is None and len(cut.tool_calls) == 2 and cut.finish_reason("length") == "length"


@pytest.mark.parametrize(
    ("text", "name", "args"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', "get_weather", {"city": "Oslo"}),
        (' {"name": "get_weather", "parameters": {"city": "Oslo"}}\n', "get_weather", {"city": "Oslo"}),
        ('{"name": "noop"}', "noop", {}),
        (CALL.replace('{"city": "Paris"}', json.dumps('{"city": "Rome"}')), "get_weather", {"city": "Rome"}),
    ],
)
def test_a_bare_json_call_or_string_arguments_are_calls(text, name, args):
    out = tools_of().parse(text)
    assert [c["function"]["name"] for c in out.tool_calls] == [name] and arguments(out.tool_calls[0]) == args


@pytest.mark.parametrize(
    "text",
    [
        "I could call get_weather for you.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # invalid JSON
        CALL.replace("get_weather", "get_time"),  # an unknown function
        CALL.replace('{"city": "Paris"}', "[1]"),  # arguments that are not an object
        CALL[:-5],  # cut short (max_tokens)
        '{"name": "get_time", "arguments": {}}',
        '{"name": "noop", "arguments": {}} and more',
        "",
    ],
)
def test_anything_else_stays_content(text):
    out = tools_of().parse(text)
    assert out.content == text and out.tool_calls == () and out.finish_reason("stop") == "stop"
    assert "tool_calls" not in out.message()


def test_a_bad_block_stays_content_beside_good_ones():
    bad = "<tool_call>\nnot json\n</tool_call>"
    out = tools_of().parse(f"{bad}\n{NOOP_CALL} done")
    assert out.content == f"{bad}\ndone" and len(out.tool_calls) == 1
    assert tools_of("none").parse(CALL).content == CALL  # "none": text is text


# ---- streaming ------------------------------------------------------------------------------


def stream(tools: ChatTools, pieces: list[str]) -> tuple[list[str], Any]:
    s = tools.stream()
    return [s.feed(p) for p in pieces], s.flush()


def test_content_streams_at_once_and_calls_come_at_the_end():
    sent, tail = stream(tools_of(), ["Hello", " world", "!"])
    assert sent == ["Hello", " world", "!"] and tail.content == "" and tail.tool_calls == []
    sent, tail = stream(tools_of(), ["Sure", ".\n<tool", "_call>\n", CALL[12:], "\n"])
    assert sent == ["Sure", ".", "", "", ""]  # from the first "<" on: held
    assert tail.content == "" and tail.parse.finish_reason("stop") == "tool_calls"
    [delta] = tail.tool_calls
    assert delta["index"] == 0 and delta["id"].startswith("call_") and delta["type"] == "function"
    assert delta["function"]["name"] == "get_weather" and arguments(delta) == {"city": "Paris"}


def test_a_held_back_start_is_released_when_it_is_not_a_call():
    sent, tail = stream(tools_of(), ["a <tool", "s are", " great"])
    assert sent == ["a", " <tools are", " great"] and tail.content == "" and not tail.tool_calls
    sent, tail = stream(tools_of(), ['{"na', 'me": "noop"}'])  # could be a bare JSON call: held to the end
    assert sent == ["", ""] and tail.content == "" and tail.tool_calls[0]["function"]["name"] == "noop"
    sent, tail = stream(tools_of(), ['{"a', 'nswer": 42}'])  # cannot be one: released
    assert "".join(sent) == '{"answer": 42}' and tail.content == ""
    sent, tail = stream(tools_of(), ["Maybe <tool_call>x"])  # a block that is no call: content at the end
    assert sent == ["Maybe"] and tail.content == " <tool_call>x"
    assert stream(tools_of("none"), [CALL])[0] == [CALL]  # "none": everything is content


@pytest.mark.parametrize(
    "text",
    [
        "plain text, no calls",
        "  leading space and trailing   ",
        f"Let me check.\n\n{CALL}\n{NOOP_CALL}\n",
        f"{CALL} and then some <tool_call>bad</tool_call> text {NOOP_CALL}",
        '{"name": "noop", "arguments": {}}',
        '  {"name": "nope"}',
        "a<<tool_call<tool_call>",
    ],
)
def test_streamed_content_equals_the_parsed_content(text):
    for size, tools in [(1, tools_of()), (3, tools_of()), (7, tools_of()), (5, tools_of("required"))]:
        sent, tail = stream(tools, [text[i : i + size] for i in range(0, len(text), size)])
        whole = tools.parse(text)
        assert "".join(sent) + tail.content == (whole.content or "")
        assert [c["function"] for c in tail.tool_calls] == [c["function"] for c in whole.tool_calls]
