"""Tools beside a response format, as agent frameworks send them (openai-agents: an agent with
tools and an output type), and strict object schemas: the grammar, token by token, and the
answers through the official client."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchserve.grammar import GrammarCompiler, allows
from batchserve.request import Constraint
from batchserve.server.openai.options import ResponseFormat, strict_schema
from batchserve.server.openai.tools import parse_tool_request
from batchserve.trees import DraftTree
from tests.conftest import TINY_VOCAB, make_tiny_tokenizer
from tests.server.test_openai_api import _client
from tests.server.test_openai_tool_calls import COLOR, MODE, USER, valid

ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": ANSWER_SCHEMA, "strict": True}}
CALL = '<tool_call>\n{"name": "pick_color", "arguments": {"color": "red"}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(make_tiny_tokenizer(), TINY_VOCAB, max_chars=20000)


def _allows(compiler: GrammarCompiler, constraint: Constraint, text: str) -> bool:
    """Whether the grammar takes `text` whole (the tiny tokenizer's ids are the bytes)."""
    g = compiler.matcher(compiler.compile(constraint))
    tokens = list(text.encode())
    pruned, masks = g.prune(DraftTree.chain(tokens))
    if pruned is None or len(pruned) != len(tokens):
        return False
    return allows(masks[-1], g.eos_token_id)  # and it may end there


def _constraint(choice: Any, fmt: dict[str, Any] | None) -> Constraint | None:
    tools = parse_tool_request([MODE, COLOR], choice, True, 60000)
    assert tools is not None
    return tools.constraint(ResponseFormat(**fmt).constraint() if fmt is not None else None)


def test_auto_beside_a_response_format_takes_a_call_or_an_answer_and_nothing_else(compiler):
    union = _constraint("auto", FORMAT)
    assert union is not None and union.kind == "grammar"
    assert _allows(compiler, union, CALL)
    assert _allows(compiler, union, '{"answer": "yes"}')
    assert not _allows(compiler, union, '{"answer": "maybe"}')  # not the format
    assert not _allows(compiler, union, '{"answer": "yes", "why": "x"}')  # strict: no undeclared key
    assert not _allows(compiler, union, "Sure, here you go")  # free text is neither
    json_object = _constraint("auto", {"type": "json_object"})
    assert _allows(compiler, json_object, '{"anything": [1, 2]}') and _allows(compiler, json_object, CALL)
    regex = _constraint("auto", {"type": "regex", "regex": "(yes|no)/[0-9]"})
    assert _allows(compiler, regex, "no/7") and not _allows(compiler, regex, "no7")
    assert _constraint("auto", None) is None  # no format: the output stays free


def test_required_and_a_named_function_force_the_call_whatever_the_format(compiler):
    for choice in ("required", {"type": "function", "function": {"name": "pick_color"}}):
        forced = _constraint(choice, FORMAT)
        assert forced is not None and _allows(compiler, forced, CALL)
        assert not _allows(compiler, forced, '{"answer": "yes"}')  # the format is the next turn's


def test_tool_parameters_are_strict_and_json_schema_only_with_strict(compiler):
    loose = {"type": "object", "properties": {"tasks": {"type": "array", "items": {"type": "string"}}}}
    tool = {"type": "function", "function": {"name": "plan", "parameters": loose}}
    tools = parse_tool_request([tool], "required", False, 60000)
    forced = tools.constraint(None)
    plan = '<tool_call>\n{"name": "plan", "arguments": {%s}}\n</tool_call>'
    assert _allows(compiler, forced, plan % '"tasks": ["a"]')
    assert not _allows(compiler, forced, plan % '"John": 30')  # instructor's empty extraction, before
    for strict, invented in ((True, False), (False, True), (None, True)):
        fmt = ResponseFormat(type="json_schema", json_schema={"name": "t", "schema": loose, "strict": strict})
        assert _allows(compiler, fmt.constraint(), '{"tasks": ["a"], "John": 30}') is invented, strict
    # Nested objects close too; what a schema says itself stands.
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "object", "additionalProperties": True}},
              "$defs": {"d": {"properties": {"e": {}}}}}  # fmt: skip
    closed = strict_schema(nested)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert nested == json.loads(json.dumps(nested)) and "additionalProperties" not in nested  # the input untouched


async def test_through_the_client_required_with_a_format_calls_and_auto_answers_one_or_the_other(api):
    client = _client(api)
    forced = await client.chat.completions.create(
        model="tiny", messages=USER, tools=[MODE, COLOR], tool_choice="required", response_format=FORMAT,
        max_tokens=128, temperature=0,
    )  # fmt: skip
    calls = forced.choices[0].message.tool_calls
    assert calls and forced.choices[0].finish_reason == "tool_calls"
    assert all(valid(c.function.name, c.function.arguments) for c in calls)
    answers = await client.chat.completions.create(
        model="tiny", messages=USER, tools=[MODE, COLOR], response_format=FORMAT, max_tokens=128,
        temperature=1.0, seed=5, n=4,
    )  # fmt: skip
    for choice in answers.choices:
        if choice.message.tool_calls:
            assert all(valid(c.function.name, c.function.arguments) for c in choice.message.tool_calls)
        elif choice.finish_reason == "stop":
            assert set(json.loads(choice.message.content)) == {"answer"}
