"""The grammars of tool calls (llguidance's Lark dialect): `<tool_call>` blocks calling the offered
functions with arguments valid for their strict schemas, alone (`required`, a named function) or
beside an answer in the response format (`auto` with a `response_format`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from batchserve.grammar.compiler import JSON_OPTIONS
from batchserve.request import Constraint
from batchserve.server.openai.errors import ApiError
from batchserve.server.openai.options import strict_schema
from batchserve.text import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


class Tool(Protocol):
    """A function the grammar offers (`tools.Tool`): its name and its arguments' schema."""

    @property
    def name(self) -> str: ...

    @property
    def parameters(self) -> dict[str, Any]: ...


MAX_FORCED_CALLS = 8  # calls in one forced output ("required" with parallel_tool_calls)
# The layout a forced call is written in: HEAD, the name as a JSON string, ARGS, the arguments, TAIL.
HEAD, ARGS, TAIL = TOOL_CALL_OPEN + '\n{"name": ', ', "arguments": ', "}\n" + TOOL_CALL_CLOSE


def calls_grammar(tools: Sequence[Tool], parallel: bool, answer: str | None = None) -> str:
    """A Lark grammar (llguidance's dialect) of `<tool_call>` blocks, each calling one of `tools`
    with arguments valid for its (strict) schema: 1 to MAX_FORCED_CALLS ("\\n"-separated) if
    `parallel`, else one. With `answer` (a rule's body: the response format), the output is either
    the calls or that answer. The name is a literal and the arguments' schema stays its own root
    (its `$ref`s resolve)."""
    repeat = f' ("\\n" call){{0,{MAX_FORCED_CALLS - 1}}}' if parallel else ""
    head, tail = json.dumps(HEAD), json.dumps(TAIL)
    alternatives = " | ".join(f"f{i}" for i in range(len(tools)))
    # A newline may end the output: a model that writes one before its end-of-turn must not be
    # forced into another call by it (measured: SmolLM2 then repeats the call to max_tokens).
    calls = f'call{repeat} "\\n"?'
    top = ["start: calls | answer", f"calls: {calls}", f"answer: {answer}"] if answer else [f"start: {calls}"]
    lines = [*top, f"call: {head} ({alternatives}) {tail}"]
    for i, t in enumerate(tools):
        # Our JSON options override the schema's own: the layout json.dumps writes, as elsewhere.
        schema = {**strict_schema(t.parameters), "x-guidance": JSON_OPTIONS}
        name = json.dumps(json.dumps(t.name) + ARGS)
        lines.append(f"f{i}: {name} a{i}")
        lines.append(f"a{i}: %json {json.dumps(schema)}")
    return "\n".join(lines) + "\n"


def harmony_calls_grammar(tools: Sequence[Tool]) -> str:
    """A Lark grammar of one call in gpt-oss's harmony markup (`channels.py` reads it back as a
    tool call): the model's `analysis` message if it writes one, then a `commentary` message to
    one of `tools` (`to=functions.NAME <|constrain|>json`) with arguments valid for its (strict)
    schema, ended by `<|call|>`. The markers are the vocabulary's special tokens, never their text;
    the analysis is any text. Harmony calls one function a turn: `parallel_tool_calls` changes nothing."""
    alternatives = " | ".join(f"f{i}" for i in range(len(tools)))
    lines = [
        "start: analysis? call",
        'analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"',
        "THOUGHT: /(.|\\n)*/",
        f'call: <|channel|> "commentary to=functions." ({alternatives}) <|call|>',
    ]
    for i, t in enumerate(tools):
        schema = {**strict_schema(t.parameters), "x-guidance": JSON_OPTIONS}
        lines.append(f'f{i}: {json.dumps(t.name)} " " <|constrain|> "json" <|message|> a{i}')
        lines.append(f"a{i}: %json {json.dumps(schema)}")
    return "\n".join(lines) + "\n"


def answer_rule(fmt: Constraint) -> str:
    """The body of a Lark rule for an answer in the response format `fmt` (beside calls, "auto")."""
    if fmt.kind == "json_object":
        return f"%json {json.dumps({'type': 'object', 'x-guidance': JSON_OPTIONS})}"
    if fmt.kind == "json_schema":
        schema = json.loads(fmt.spec)
        return f"%json {json.dumps(schema if isinstance(schema, bool) else {**schema, 'x-guidance': JSON_OPTIONS})}"
    if fmt.kind == "regex":
        return _regex_literal(fmt.spec)
    raise ApiError(
        400, f"a {fmt.kind} response_format cannot stand beside tools under tool_choice 'auto'", "response_format"
    )


def _regex_literal(regex: str) -> str:
    """`regex` as a Lark `/.../` literal that nothing in it can end early: llguidance's own
    escaping (an unescaped `/`, a newline...), with the regex's meaning kept."""
    from llguidance import regex_to_lark

    if (len(regex) - len(regex.rstrip("\\"))) % 2:  # llguidance would drop it: a different regex
        raise ApiError(400, "response_format.regex: ends in an unescaped backslash", "response_format.regex")
    return f"/{regex_to_lark(regex, '')}/"


def cut_call(text: str, names: Sequence[str]) -> tuple[str, str] | None:
    """(name, arguments so far) of a forced call that `text` (from its `<tool_call>` on) begins
    and max_tokens (or a stop) cut short, read in the grammar's layout: None where the name is
    not told yet. Arguments that are whole (only the closing tags were cut) come back whole."""
    if not (HEAD.startswith(text) or text.startswith(HEAD)):
        return None  # not the grammar's layout
    body = text[len(HEAD) :]
    seen = [n for n in names if (json.dumps(n) + ARGS).startswith(body) or body.startswith(json.dumps(n) + ARGS)]
    if len(seen) != 1:
        return None
    args = body[len(json.dumps(seen[0]) + ARGS) :]
    try:
        value, end = json.JSONDecoder().raw_decode(args)
    except (ValueError, RecursionError):
        return seen[0], args
    return seen[0], json.dumps(value, ensure_ascii=False) if TAIL.startswith(args[end:]) else args
