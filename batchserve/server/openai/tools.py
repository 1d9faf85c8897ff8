"""OpenAI tool calling for /v1/chat/completions: `tools`, `tool_choice` and `parallel_tool_calls`
checked, the constraint that forces calls, and the calls parsed out of the output (whole or streamed).

How a chat handler uses it::

    tools = parse_tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, limits.max_constraint_chars)
    # None: the request has no tools (or only tool_choice "none"); it is plain chat.
    ids = text.render_chat(messages, tools.prompt_tools if tools else None)
    constraint = tools.constraint(response_format_constraint)  # "required" / a named function
    out = tools.parse(text)  # ToolParse: content (None when only calls) and OpenAI tool_calls
    finish_reason = out.finish_reason(engine_finish_reason)  # "stop" becomes "tool_calls"
    # Streaming: s = tools.stream(); s.feed(delta) -> content to send now; s.flush() -> ToolStreamTail.

The model writes a call as a Hermes-style block, one block per call (`batchserve.text.format_tool_call`)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The tool list reaches the prompt through the model's chat template where it renders tools, or
else as a system message (`batchserve.text.TOOLS_PROMPT`). With "none" the list is left out of the
prompt (the model must not call) and the output is plain content. "auto" constrains nothing: a
block whose JSON names a known function with object arguments becomes a call (as does a whole
output that is one such JSON object); any other text stays content. "required" and a named function
constrain the output (an llguidance Lark grammar, `%json` per function's `parameters`) to calls of
known functions with schema-valid arguments: one to MAX_FORCED_CALLS ("\\n"-separated, a "\\n"
may end them) with `parallel_tool_calls`, else exactly one; a named function: exactly one call of
it. The bound stops a small model that repeats its call from filling max_tokens with copies.
Forced calls have no content; one that max_tokens cuts short is still a call, its arguments as far as
they got (finish_reason "length"). With `parallel_tool_calls` false, parsing keeps only the first call.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from batchserve.request import Constraint
from batchserve.server.openai.errors import ApiError
from batchserve.server.openai.options import MAX_SCHEMA_DEPTH, too_deep
from batchserve.server.openai.tool_grammar import answer_rule, calls_grammar, cut_call, harmony_calls_grammar
from batchserve.text import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

MAX_TOOLS = 128  # each one is in the prompt and in a forced call's grammar
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
CHOICES = ("none", "auto", "required")
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # `parameters` omitted
# A block, from its opening tag to the first closing tag, with no other opening tag inside.
_BLOCK = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"((?:(?!" + re.escape(TOOL_CALL_OPEN) + r").)*?)" + re.escape(TOOL_CALL_CLOSE),
    re.DOTALL,
)
# The starts of a whole output that is a bare JSON call (whitespace removed).
_JSON_CALL_STARTS = ('{"name"', '{"arguments"', '{"parameters"')


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call."""

    name: str
    parameters: dict[str, Any]  # JSON Schema of its arguments, an object
    spec: dict[str, Any]  # the tool as the request sent it (what the prompt shows)


@dataclass(frozen=True, slots=True)
class ToolParse:
    """The output split into content and calls."""

    content: str | None  # None when the output is only calls
    tool_calls: tuple[dict[str, Any], ...]  # OpenAI objects: id, type "function", function {name, arguments}
    cut: bool = False  # the last call is a forced one cut short: its arguments as far as they got

    def finish_reason(self, reason: str) -> str:
        """OpenAI's "tool_calls" when the model stopped after calling; any other reason (length) stays."""
        return "tool_calls" if self.tool_calls and reason == "stop" and not self.cut else reason

    def message(self) -> dict[str, Any]:
        """The response's assistant message (`tool_calls` only when there are some)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        return out | {"tool_calls": list(self.tool_calls)} if self.tool_calls else out


@dataclass(frozen=True, slots=True)
class ToolStreamTail:
    """What a stream sends at its end."""

    content: str  # content not sent yet ("" for none)
    tool_calls: list[dict[str, Any]]  # `delta.tool_calls` entries: index, id, type, function {name, arguments}
    parse: ToolParse  # the whole output's parse (for finish_reason)


@dataclass(frozen=True, slots=True)
class ChatTools:
    """A request's checked tool settings (`parse_tool_request`)."""

    tools: tuple[Tool, ...]
    choice: str  # none | auto | required | function (the one in `function`)
    function: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls
    harmony: bool = False  # the model writes gpt-oss's harmony markup: a forced call is written in it

    @property
    def forced(self) -> bool:
        """The output is constrained to calls ("required", a named function)."""
        return self.choice in ("required", "function")

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools to render into the prompt (`TextCodec.render_chat`); None with "none"."""
        return None if self.choice == "none" else [t.spec for t in self.tools]

    def constraint(self, response_format: Constraint | None = None) -> Constraint | None:
        """What the output must match: under "required" or a named function, the calls (a
        `response_format` is the next turn's answer, after the tool results); under "auto" with a
        `response_format`, either calls or an answer in that format; else the format alone. On a
        harmony model a forced call is written in its own markup (`harmony_calls_grammar`)."""
        if self.forced and self.harmony:
            chosen = [t for t in self.tools if self.choice != "function" or t.name == self.function]
            return Constraint("grammar", harmony_calls_grammar(chosen))
        if self.choice == "function":
            return Constraint("grammar", calls_grammar([t for t in self.tools if t.name == self.function], False))
        if self.forced:
            return Constraint("grammar", calls_grammar(self.tools, self.parallel))
        if self.choice == "auto" and response_format is not None:
            return Constraint("grammar", calls_grammar(self.tools, self.parallel, answer_rule(response_format)))
        return response_format

    def parse(self, text: str) -> ToolParse:
        """The finished output as content and calls (module docstring). Whitespace next to a call
        is dropped; content around calls is joined by newlines. Forced calls have no content: what
        follows them is a call that max_tokens cut short, kept as far as it got (never as markup)."""
        if self.choice == "none":
            return ToolParse(text, ())
        known = {t.name for t in self.tools}
        calls: list[dict[str, Any]] = []
        pieces: list[str] = []
        last = 0
        for m in _BLOCK.finditer(text):
            call = _call(m.group(1), known)
            if call is not None:
                pieces.append(text[last : m.start()])
                calls.append(call)
                last = m.end()
        if self.forced:
            names = [self.function] if self.function is not None else [t.name for t in self.tools]
            cut = cut_call(text[last:].lstrip("\n"), names) if text[last:].strip() else None
            kept = [*calls, as_call(*cut)] if cut is not None else calls
            kept = kept if self.parallel else kept[:1]
            return ToolParse(None, tuple(kept), cut is not None and len(kept) > len(calls))
        if not calls:
            whole = _call(text, known) if text.lstrip().startswith("{") else None
            return ToolParse(None, (whole,)) if whole else ToolParse(text, ())
        pieces.append(text[last:])
        n = len(pieces)
        kept = [p.rstrip() if i < n - 1 else p for i, p in enumerate(pieces)]
        kept = [p.lstrip() if i > 0 else p for i, p in enumerate(kept)]
        content = "\n".join(p for p in kept if p)
        return ToolParse(content or None, tuple(calls if self.parallel else calls[:1]))

    def stream(self) -> ToolStream:
        """A parser for this request's streamed output."""
        return ToolStream(self, _held=self.forced)  # forced: the output is calls only


def parse_tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any, max_chars: int) -> ChatTools | None:
    """The request's tool settings checked (400 naming the field for anything wrong), or None for
    a request without tools. `max_chars`: the bound on their schemas (the server's
    `limits.max_constraint_chars`), measured as the forcing grammar of all of them."""
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "tools must be a list of function tools", "tools")
    if tools and len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools: {len(tools)} tools, at most {MAX_TOOLS}", "tools")
    checked: list[Tool] = []
    for i, spec in enumerate(tools or ()):
        tool = _check_tool(i, spec)
        if any(t.name == tool.name for t in checked):
            param = f"tools[{i}].function.name"
            raise ApiError(400, f"{param}: {tool.name!r} is defined twice", param)
        checked.append(tool)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ApiError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
    choice, function = _check_choice(tool_choice, {t.name for t in checked})
    if not checked:
        if choice != "none":
            raise ApiError(400, f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return None
    try:
        size = len(calls_grammar(checked, True))
    except (ValueError, RecursionError):  # nested past what JSON text can be written for
        raise ApiError(400, "tools: a schema is nested too deeply", "tools") from None
    if size > max_chars:
        raise ApiError(400, f"tools: their schemas take {size} characters, at most {max_chars}", "tools")
    return ChatTools(tuple(checked), choice, function, parallel_tool_calls is not False)


def _check_tool(i: int, spec: Any) -> Tool:
    at = f"tools[{i}]"

    def bad(path: str, problem: str) -> ApiError:
        return ApiError(400, f"{at}{path} {problem}", at + path)

    if not isinstance(spec, dict):
        raise bad("", "must be an object")
    if spec.get("type") != "function":
        raise bad(".type", f"must be 'function', got {spec.get('type')!r}")
    fn = spec.get("function")
    if not isinstance(fn, dict):
        raise bad(".function", "must be an object")
    unknown = [f".{k}" for k in spec if k not in ("type", "function")]
    unknown += [f".function.{k}" for k in fn if k not in ("name", "description", "parameters", "strict")]
    if unknown:
        raise bad(unknown[0], "is not a known field")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad(".function.name", f"must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad(".function.description", "must be a string")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise bad(".function.strict", "must be a boolean")
    params = fn.get("parameters")
    if params is None:
        params = NO_ARGUMENTS
    elif not isinstance(params, dict) or params.get("type", "object") != "object":
        raise bad(".function.parameters", "must be a JSON Schema of an object")
    elif too_deep(params, MAX_SCHEMA_DEPTH):
        raise bad(".function.parameters", f"is nested deeper than {MAX_SCHEMA_DEPTH} (MAX_SCHEMA_DEPTH)")
    return Tool(name, params, spec)


def _check_choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    """(none | auto | required | function, the named function); the default: auto with tools."""
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ApiError(
                400, f"tool_choice must be none, auto, required or a function, got {choice!r}", "tool_choice"
            )
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function" or set(choice) != {"type", "function"}:
        raise ApiError(400, 'tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    name = fn.get("name")
    if not isinstance(name, str) or set(fn) != {"name"}:
        raise ApiError(400, "tool_choice.function must be {name: <a function's name>}", "tool_choice.function.name")
    if name not in names:
        raise ApiError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice.function.name")
    return "function", name


def _call(body: str, known: set[str]) -> dict[str, Any] | None:
    """An OpenAI tool call from a block's JSON, or None if it is not a call of a known function."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("name") not in known:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))  # Llama-style models write "parameters"
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return as_call(obj["name"], json.dumps(args, ensure_ascii=False))


def as_call(name: str, arguments: str) -> dict[str, Any]:
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": function}


@dataclass(slots=True)
class ToolStream:
    """One streamed output's parser: `feed` each text delta, send what it returns as content now;
    `flush` at the end. Content passes through at once, except what could still belong to a call:
    a suffix that may be the start of `<tool_call>` (released once it is not), whitespace at the
    end, everything from a `<tool_call>` on, and an output that so far could be a bare JSON call.
    The content sent plus the tail's equals `ToolParse.content` of the whole output."""

    tools: ChatTools
    _parts: list[str] = field(default_factory=list)  # every delta (the whole output, for flush)
    _pending: str = ""  # text after what was sent, held back
    _sent: int = 0  # characters sent as content
    _held: bool = False  # a call may have begun: nothing more is sent before flush
    _json_ruled_out: bool = False  # the output does not start like a bare JSON call

    def feed(self, delta: str) -> str:
        """The content to send now for one more piece of output text."""
        self._parts.append(delta)
        if self.tools.choice == "none":
            self._sent += len(delta)
            return delta
        if self._held:
            return ""
        text = self._pending + delta
        if not self._json_ruled_out and self._sent == 0:
            compact = re.sub(r"\s+", "", text[:64])
            if any(compact.startswith(s) for s in _JSON_CALL_STARTS):
                self._held = True
            if self._held or not compact or any(s.startswith(compact) for s in _JSON_CALL_STARTS):
                self._pending = text
                return ""
            self._json_ruled_out = True
        at = text.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._held = True
            end = at
        else:
            end = len(text) - _partial_tag(text)
        out = text[:end].rstrip()  # whitespace may precede a call (dropped then): sent with what follows
        self._pending = text[len(out) :]
        self._sent += len(out)
        return out

    def flush(self) -> ToolStreamTail:
        """The end of the output: the content not sent yet, and the calls as stream deltas."""
        parse = self.tools.parse("".join(self._parts))
        deltas = [{"index": i, **call} for i, call in enumerate(parse.tool_calls)]
        return ToolStreamTail((parse.content or "")[self._sent :], deltas, parse)


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that is a proper start of `<tool_call>`."""
    for n in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
