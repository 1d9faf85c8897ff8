"""The OpenAI Responses API's request (`POST /v1/responses`), turned into the chat request the
engine already serves: `instructions` a system message, `input` a text, token ids (batchserve's
extension: a raw prompt, no template) or items (messages, earlier `function_call`s and their
`function_call_output`s), function `tools` and `tool_choice` in chat's shape, `text.format` a
`response_format`. Nothing is stored, so `previous_response_id` is a 400 saying to send the
conversation as input."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from batchserve.request import MAX_INT32, MAX_TEMPERATURE, SEED_RANGE
from batchserve.server.openai.bodies import ChatRequest
from batchserve.server.openai.errors import ApiError
from batchserve.server.openai.fields import NeutralFields
from batchserve.server.openai.options import OBFUSCATION_REFUSED

# Fields of OpenAI's request that ask for nothing at these values (else a 400 saying why).
_NONE_ONLY = {
    "background": "no background responses here: the answer comes on this connection",
    "conversation": "no conversations are stored here: send the whole conversation as input",
    "prompt": "no stored prompt templates here",
    "context_management": "no context management here",
    "access_programs": "no access programs here",
    "image": "no image output here",
    "background_options": "no background responses here",
    "max_tool_calls": "no built-in tools run here: the function calls are the client's to run",
}


class ResponsesRequest(NeutralFields):
    """`POST /v1/responses`'s body. Unknown fields are a 400 naming them."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[int] | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])  # an extra, as on chat
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no padding is added here
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {...}, "verbosity": ...}
    previous_response_id: str | None = None
    user: str | None = Field(default=None, max_length=256)
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    access_programs: Any = None
    image: Any = None
    background_options: Any = None
    max_tool_calls: Any = None

    def unsupported(self) -> None:
        """400 naming a field set to something batchserve cannot honour, with why."""
        if self.previous_response_id is not None:
            raise ApiError(
                400, "previous_response_id: responses are not stored here: send the conversation as input",
                "previous_response_id",
            )  # fmt: skip
        refused = self.refusal()
        if refused is not None:
            raise ApiError(400, refused[1], refused[0])
        for name, why in _NONE_ONLY.items():
            if getattr(self, name) not in (None, False):
                raise ApiError(400, f"{name}: {why}", name)
        checks = (
            ("truncation", self.truncation in (None, "disabled"), "only 'disabled': a prompt too long is a 400"),
            ("include", not self.include, "nothing extra to include here"),
            ("reasoning", not self.reasoning or self.reasoning.get("effort") in (None, "none"), "no reasoning here"),
            ("top_logprobs", not self.top_logprobs, "logprobs are on the chat and completions endpoints"),
            ("stream_options", set(self.stream_options or {}) <= {"include_obfuscation"}, "include_obfuscation only"),
            ("stream_options", not (self.stream_options or {}).get("include_obfuscation"), OBFUSCATION_REFUSED),
        )
        for name, ok, why in checks:
            if not ok:
                raise ApiError(400, f"{name}: {why}", name)

    @property
    def token_ids(self) -> list[int] | None:
        """The raw prompt where `input` is token ids (no chat template), else None."""
        return self.input if isinstance(self.input, list) and self.input and isinstance(self.input[0], int) else None  # type: ignore[return-value]

    def chat(self) -> ChatRequest:
        """The chat request this asks for (its messages unused where the input is token ids)."""
        if self.token_ids is not None and self.tools:
            raise ApiError(400, "tools need messages as input, not token ids", "tools")
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": _messages(self.instructions, self.input if self.token_ids is None else ""),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "user": self.user,
            "tools": [_tool(i, t) for i, t in enumerate(self.tools)] if self.tools else None,
            "tool_choice": _tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": _format((self.text or {}).get("format")),
            "verbosity": (self.text or {}).get("verbosity"),
        }
        try:
            return ChatRequest(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            param = _field(".".join(str(x) for x in err.get("loc", ())))
            raise ApiError(400, f"{param}: {err.get('msg', 'invalid')}", param or None) from None


# Chat's fields as this request names them (a 400 names the field the client sent).
_FIELDS = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
)


def _field(param: str) -> str:
    """A chat request's field as this request names it."""
    for chat, ours in _FIELDS:
        if param == chat or param.startswith(chat + "."):
            return ours + param[len(chat) :]
    return param


def _messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages: the instructions as a system message, then the input's items."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}] if items or not out else out
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            if not isinstance(item.get("role"), str):
                raise ApiError(400, f"input[{i}].role: a message's role is a string", f"input[{i}].role")
            out.append({"role": item["role"], "content": _text(i, item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last.get("role") == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)  # calls of one turn: one assistant message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(i, output)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        else:
            raise ApiError(400, f"input[{i}]: items of type {kind!r} are not supported here", f"input[{i}].type")
    return out


def _text(i: int, content: Any) -> str:
    """A message's text: a string, or its text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content if isinstance(content, list) else [None]:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise ApiError(400, f"input[{i}].content: only text parts are supported", f"input[{i}].content")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool in chat's shape (`{"type": "function", "function": {...}}`)."""
    if tool.get("type") != "function":
        raise ApiError(400, f"tools[{i}]: only function tools run here, got {tool.get('type')!r}", f"tools[{i}].type")
    spec = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": spec}


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(fmt: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`; 400 naming it where it is not an object."""
    if fmt is not None and not isinstance(fmt, dict):
        raise ApiError(400, f"text.format: must be an object such as {{'type': 'json_object'}}, got {fmt!r:.80}",
                       "text.format")  # fmt: skip
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "description", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec | {"schema": fmt.get("schema")}}
    return fmt
