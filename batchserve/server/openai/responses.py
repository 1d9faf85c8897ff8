"""The Responses API's answers: the `response` object (output items: an assistant `message` with
its `output_text`, and `function_call`s), and its stream of OpenAI's typed events
(`response.created`, `response.output_item.added`, `response.output_text.delta`, ...,
`response.completed`), built from the engine's outputs of one request."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from batchserve.request import FinishReason, RequestOutput
from batchserve.server.frontend import EngineFailed
from batchserve.server.openai.answers import constraint_failure, usage
from batchserve.server.openai.channels import ChannelSplit, joined, split_channels
from batchserve.server.openai.responses_bodies import ResponsesRequest
from batchserve.server.openai.tools import ChatTools, ToolParse, as_call


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part] if text else []}


def _function_call(call: dict[str, Any], arguments: str | None = None, cut: bool = False) -> dict[str, Any]:
    """A chat tool call (`tools`) as a Responses output item (`cut`: max_output_tokens cut it short)."""
    status = "in_progress" if arguments is not None else "incomplete" if cut else "completed"
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if arguments is None else arguments,
        "status": status,
    }


@dataclass(slots=True)
class ResponseAnswer:
    """One call's response object, whole or as events."""

    body: ResponsesRequest
    model: str
    tools: ChatTools | None
    channels: bool = False  # gpt-oss's harmony markup: the `final` channel is the output text, the analysis left out
    id: str = field(default_factory=lambda: _id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0

    def _object(self, status: str, output: list[dict[str, Any]], last: RequestOutput | None) -> dict[str, Any]:
        b = self.body
        fmt = (b.text or {}).get("format") or {"type": "text"}
        obj: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "temperature": b.temperature, "top_p": b.top_p,
            "parallel_tool_calls": b.parallel_tool_calls is not False, "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [], "text": {"format": fmt}, "previous_response_id": None, "store": False,
            "truncation": "disabled", "user": b.user, "metadata": b.metadata or {}, "error": None,
            "incomplete_details": None, "usage": None,
        }  # fmt: skip
        if last is not None and last.finished:
            if last.finish_reason is FinishReason.LENGTH:
                obj["status"], obj["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            u = usage([(0, last)])
            obj["usage"] = {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                    "cache_write_tokens": 0,  # the prefix cache writes as it computes: nothing extra
                },
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"],
            }
        return obj

    def _parse(self, text: str) -> ToolParse:
        called: tuple[dict[str, Any], ...] = ()
        if self.channels:  # gpt-oss: the final channel is the text, a message to a function a call
            split = split_channels(text)
            text, called = split.content, tuple(as_call(*c) for c in split.calls)
        parsed = self.tools.parse(text) if self.tools is not None else ToolParse(text, ())
        return replace(parsed, tool_calls=parsed.tool_calls + called) if called else parsed

    def whole(self, text: str, last: RequestOutput) -> dict[str, Any]:
        """The response object of a finished call whose output is `text`."""
        parsed = self._parse(text)
        output = [_message(_id("msg"), parsed.content)] if parsed.content else []
        last_call = len(parsed.tool_calls) - 1
        output += [_function_call(c, cut=parsed.cut and i == last_call) for i, c in enumerate(parsed.tool_calls)]
        return self._object("completed", output, last)

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    async def stream(
        self, first: RequestOutput, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[str]:
        """The call's events; closing `outputs` (a client that left) aborts the request."""
        yield self._event("response.created", response=self._object("in_progress", [], None))
        yield self._event("response.in_progress", response=self._object("in_progress", [], None))
        state = _TextState(_id("msg"))
        parser = self.tools.stream() if self.tools is not None else None
        channels = ChannelSplit() if self.channels else None
        called: list[dict[str, Any]] = []  # gpt-oss's calls to functions
        out: RequestOutput | None = first
        try:
            while out is not None:
                last = out
                delta = out.new_text
                if channels is not None:
                    split = joined(channels.feed(delta), channels.flush()) if out.finished else channels.feed(delta)
                    delta, called = split.content, [*called, *(as_call(*c) for c in split.calls)]
                delta = parser.feed(delta) if parser is not None else delta
                for event in state.text(self, delta):
                    yield event
                if (failure := constraint_failure(out)) is not None:
                    yield self._event("error", code="invalid_request_error", message=failure, param="text.format")
                    return
                item = await anext(outputs, None)
                out = item[1] if item is not None else None
        except EngineFailed as e:
            yield self._event("error", code="server_error", message=str(e), param=None)
            return
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        tail = parser.flush() if parser is not None else None
        for event in state.text(self, tail.content if tail is not None else ""):
            yield event
        output = [item for item in [state.close_item(self)] if item is not None]
        for event in state.close_events:
            yield event
        calls = [*(tail.parse.tool_calls if tail is not None else ()), *called]
        for n, call in enumerate(calls):
            index = len(output)
            yield self._event("response.output_item.added", output_index=index, item=_function_call(call, ""))
            item = _function_call(call, cut=tail is not None and tail.parse.cut and n == len(calls) - 1)
            args = {"item_id": item["id"], "output_index": index}
            yield self._event("response.function_call_arguments.delta", **args, delta=item["arguments"])
            yield self._event("response.function_call_arguments.done", **args, arguments=item["arguments"])
            yield self._event("response.output_item.done", output_index=index, item=item)
            output.append(item)
        final = self._object("completed", output, last)
        yield self._event(f"response.{final['status']}", response=final)


@dataclass(slots=True)
class _TextState:
    """The streamed assistant message: opened at its first text, closed at the end."""

    item_id: str
    text_so_far: str = ""
    opened: bool = False
    close_events: list[str] = field(default_factory=list)

    def text(self, answer: ResponseAnswer, delta: str) -> list[str]:
        if not delta:
            return []
        events = []
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        if not self.opened:
            self.opened = True
            item = _message(self.item_id, "", "in_progress")
            events.append(answer._event("response.output_item.added", output_index=0, item=item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(answer._event("response.content_part.added", **where, part=part))
        self.text_so_far += delta
        events.append(answer._event("response.output_text.delta", **where, delta=delta, logprobs=[]))
        return events

    def close_item(self, answer: ResponseAnswer) -> dict[str, Any] | None:
        """The finished message item (None where no text came), its closing events kept in order."""
        if not self.opened:
            return None
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        item = _message(self.item_id, self.text_so_far)
        self.close_events = [
            answer._event("response.output_text.done", **where, text=self.text_so_far, logprobs=[]),
            answer._event("response.content_part.done", **where, part=item["content"][0]),
            answer._event("response.output_item.done", output_index=0, item=item),
        ]
        return item
